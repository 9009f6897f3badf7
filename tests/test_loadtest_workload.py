"""Workloads and configuration: length distributions, exact synthetic prompt lengths in our
tokenizer, shared prefixes, seeded reproducibility, tenants and targets from the command line."""

import random

import pytest

from loadtest.cli import parse_args, redact
from loadtest.config import RunConfig, Target, TenantSpec, parse_kv
from loadtest.lengths import LengthDist
from loadtest.workload import SyntheticText, Workload, load_prompts


@pytest.fixture(scope="module")
def synthetic(tokenizer):
    return SyntheticText(tokenizer)


def test_length_distributions(tmp_path):
    rng = random.Random(0)
    assert LengthDist.parse("32").sample(rng) == 32 == LengthDist.parse("fixed:32").sample(rng)
    uniform = [LengthDist.parse("uniform:4:6").sample(rng) for _ in range(300)]
    assert set(uniform) == {4, 5, 6}
    normal = [LengthDist.parse("normal:100:10").sample(rng) for _ in range(2000)]
    assert 98 < sum(normal) / len(normal) < 102 and min(normal) >= 1 and max(normal) <= 140
    path = tmp_path / "lengths.txt"
    path.write_text("7\n9\n")
    assert {LengthDist.parse(f"file:{path}").sample(rng) for _ in range(50)} == {7, 9}
    for bad in ("0", "uniform:5:2", "normal:10", "zipf:1", "fixed:x"):
        with pytest.raises(ValueError):
            LengthDist.parse(bad)


def test_synthetic_prompts_have_exact_lengths_and_a_shared_prefix(synthetic, tokenizer):
    tenant = TenantSpec(name="t", input_len=LengthDist.parse("uniform:5:40"), shared_prefix_len=32)
    workload = Workload(tenant, seed=3, synthetic=synthetic)
    specs = [workload.next() for _ in range(20)]
    for spec in specs:
        assert list(spec.prompt_ids) == tokenizer.encode(spec.prompt)
        assert 32 + 5 <= len(spec.prompt_ids) <= 32 + 40
        assert spec.prompt_ids[:32] == specs[0].prompt_ids[:32]
    assert len({s.prompt_ids[32:] for s in specs}) == 20
    assert [s.index for s in specs] == list(range(20))


def test_same_seed_same_request_stream(synthetic):
    tenant = TenantSpec(
        name="t", input_len=LengthDist.parse("normal:30:8"), output_len=LengthDist.parse("uniform:1:9")
    )

    def stream(seed, name="t"):
        w = Workload(TenantSpec(**{**tenant.__dict__, "name": name}), seed, synthetic)
        return [w.next() for _ in range(10)]

    assert stream(1) == stream(1)
    assert stream(1) != stream(2)
    assert [s.prompt for s in stream(1)] != [s.prompt for s in stream(1, name="u")]  # tenants differ


def test_bundled_and_file_prompts(tmp_path):
    bundled = load_prompts("bundled")
    assert len(bundled) >= 30 and all(p.strip() for p in bundled)
    path = tmp_path / "p.txt"
    path.write_text("first prompt\n\nsecond prompt\n")
    assert load_prompts(str(path)) == ("first prompt", "second prompt")
    workload = Workload(TenantSpec(prompts="bundled"), seed=0, synthetic=None, prompt_set=bundled)
    spec = workload.next()
    assert spec.prompt in bundled and spec.prompt_ids is None and spec.max_tokens == 16


def test_tenant_fields_override_defaults():
    base = TenantSpec(rate_per_s=3.0, output_len=LengthDist.parse("8"))
    t = TenantSpec.from_fields(parse_kv("name=a,key=k1,weight=2,input_len=uniform:4:8"), base)
    assert (t.name, t.api_key, t.weight, t.rate_per_s, t.output_len.spec, t.input_len.spec) == (
        "a",
        "k1",
        2.0,
        3.0,
        "8",
        "uniform:4:8",
    )
    assert t.to_json()["api_key"] == "<set>"
    with pytest.raises(ValueError):
        TenantSpec.from_fields({"colour": "red"}, base)


def test_targets_and_remote_guard():
    assert Target.parse("127.0.0.1:50051", 0) == Target("target", "grpc", "127.0.0.1:50051")
    assert Target.parse("local", 0).name == "local" and Target.parse("grpc://[::1]:5", 1).name == "target1"
    assert Target.parse("llama=http://localhost:8080/", 1) == Target(
        "llama", "openai", "http://localhost:8080"
    )
    local = Target.parse("small=local:--max-num-seqs 2", 0)
    assert local.local and local.local_args == ("--max-num-seqs", "2")
    with pytest.raises(ValueError, match="loopback"):
        Target.parse("10.1.2.3:50051", 0)
    assert Target.parse("10.1.2.3:50051", 0, allow_remote=True).address == "10.1.2.3:50051"


def test_command_line_to_config():
    c = parse_args(
        [
            "--target",
            "127.0.0.1:1",
            "--concurrencies",
            "1,2,4",
            "--num-requests",
            "10",
            "--tenant",
            "name=a,key=ka",
            "--tenant",
            "name=b,key=kb,arrival=poisson,rate=2",
            "--slo",
            "ttft=1s",
        ]
    )
    assert (c.sweep, c.sweep_values) == ("concurrency", (1.0, 2.0, 4.0))
    assert (c.duration_s, c.num_requests) == (None, 10)
    assert [t.arrival for t in c.tenants] == ["closed", "poisson"]
    at4 = c.tenants_at(4.0)
    assert (at4[0].concurrency, at4[1].rate_per_s) == (4, 2.0)  # the sweep moves closed-loop tenants only
    assert dict(c.slo_s) == {"ttft": 1.0}
    assert parse_args(["--target", "127.0.0.1:1"]).duration_s == 30.0
    with pytest.raises(ValueError):
        RunConfig(targets=c.targets, tenants=c.tenants, duration_s=None, num_requests=None)
    with pytest.raises(SystemExit):
        parse_args(["--target", "127.0.0.1:1", "--rates", "1", "--concurrencies", "2"])


def test_keys_are_redacted_from_the_recorded_command():
    argv = ["--api-key", "s1", "--tenant", "name=a,key=s2,rate=1", "--tenant", "key=s3", "--api-key=s4"]
    assert redact(argv) == [
        "--api-key",
        "<set>",
        "--tenant",
        "name=a,key=<set>,rate=1",
        "--tenant",
        "key=<set>",
        "--api-key=<set>",
    ]
