"""The router never imports torch (it must stay light and start fast)."""
import subprocess
import sys

from tests.procs import REPO


def test_router_modules_do_not_import_torch():
    code = ("import sys, router.__main__, router.server, router.client; "
            "bad = [m for m in sys.modules if m == 'torch' or m.startswith(('torch.', 'worker'))]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True, timeout=60)
