"""router.models.ModelTable in process: entries, the worker check, generation defaults."""

import pathlib

import pytest

from protos.llm.v1 import generation_pb2 as pb
from protos.llm.v1 import worker_pb2
from router.models import ModelTable, entries_for, parse_entry
from router.registry import StaticRegistry, WorkerHandle
from router.validation import ModelSpec, ValidRequest
from tests.tiny_models import write_tokenizer_dir


@pytest.fixture(scope="module")
def table(tmp_path_factory) -> ModelTable:
    root = tmp_path_factory.mktemp("vocabs")
    write_tokenizer_dir("llama3", root / "llama3")
    write_tokenizer_dir("qwen2", root / "qwen2")
    return ModelTable.from_entries([f"a={root / 'llama3'}", str(root / "qwen2")])


def _info(table: ModelTable, model: str, fingerprint_of: str | None) -> worker_pb2.WorkerInfo:
    info = worker_pb2.WorkerInfo(model=model)
    if fingerprint_of is not None:
        f = table.get(fingerprint_of).fingerprint
        info.tokenizer.CopyFrom(
            worker_pb2.TokenizerFingerprint(
                vocab_size=f.vocab_size, eos_token_ids=f.eos_token_ids, vocab_sha256=f.vocab_sha256
            )
        )
    return info


def test_entries_and_ids(table: ModelTable) -> None:
    assert parse_entry("id=org/name") == ("id", "org/name")
    assert parse_entry("/m.gguf") == ("", "/m.gguf")
    assert table.ids() == ["a", "qwen2"]  # an entry without ID: the directory's name
    assert entries_for("/m", "x") == ("x=/m",) and entries_for(None, "x") == ("x=",)
    assert entries_for("/m", None) == ("/m",) and entries_for(None, None) == ()


def test_check_accepts_only_a_matching_fingerprint(table: ModelTable) -> None:
    assert table.check(_info(table, "a", "a")) == ""
    assert "differs from the router's" in table.check(_info(table, "a", "qwen2"))
    assert "no tokenizer fingerprint" in table.check(_info(table, "a", None))
    assert "which this router does not" in table.check(_info(table, "b", "a"))


def test_defaults_fill_only_unset_fields(table: ModelTable) -> None:
    req = ValidRequest(request_id="r", model=ModelSpec("a", 256, 620))
    filled = table.apply_defaults(req, pb.SamplingParams())
    assert (filled.temperature, filled.top_p) == (0.6, 0.9)  # generation_config.json
    explicit = table.apply_defaults(req, pb.SamplingParams(temperature=1.0))
    assert (explicit.temperature, explicit.top_p) == (req.temperature, 0.9)


def test_bad_entries_stop_the_router_with_the_entry_named(tmp_path: pathlib.Path, table) -> None:
    with pytest.raises(SystemExit, match="missing.gguf"):
        ModelTable.from_entries([str(tmp_path / "missing.gguf")])
    with pytest.raises(SystemExit, match="two entries serve the id 'a'"):
        ModelTable([table.get("a"), table.get("a")])


def test_lora_adapters_resolve_to_their_base_model(tmp_path_factory) -> None:
    root = tmp_path_factory.mktemp("lora-vocabs")
    write_tokenizer_dir("llama3", root / "llama3")
    write_tokenizer_dir("qwen2", root / "qwen2")
    table = ModelTable.from_entries([f"a={root / 'llama3'}", f"b={root / 'qwen2'}"])
    registry = StaticRegistry(("wa", "wb"))
    table.live, table.claimed = registry.models, registry.adapter_bases  # as router/server.py does
    assert table.get("sql") is None and table.base_id("sql") == "sql"  # no worker serves one yet
    wa, wb = (WorkerHandle(address, None, None) for address in ("wa", "wb"))
    registry._handles = {"wa": wa, "wb": wb}
    wa.info = _info(table, "a", "a")
    wa.info.adapters.extend(["sql", "chat"])
    assert table.check(wa.info) == ""
    # vetted, not healthy yet (its first probe is still running): its adapters resolve already
    assert table.get("sql") is table.get("a") and table.tokenizer("chat") is table.tokenizer("a")
    assert table.base_id("chat") == "a" and table.base_id("b") == "b"
    assert table.ids() == ["a", "b"]  # the base models: a request without a model names one of them
    # another base model's worker serving "sql" is refused, whether wa is healthy or not (its
    # breaker open, probes in flight: never two bases under one adapter name)
    wb.info = _info(table, "b", "b")
    wb.info.adapters.append("sql")
    assert "serves LoRA adapter 'sql' of 'b'; other workers, of 'a'" in table.check(wb.info)
    wa.healthy = True
    assert "other workers, of 'a'" in table.check(wb.info)
    wb.refused = table.check(wb.info)
    assert table.get("sql") is table.get("a")  # the refused worker's word does not count
    clash = _info(table, "a", "a")
    clash.adapters.append("b")  # an adapter under a served model's id
    assert "under the id of a served model, 'b'" in table.check(clash)
    # once no worker reports "sql" over "a" (wa restarted without it), it is unknown, and a
    # worker may serve it over "b"
    wa.info = _info(table, "a", "a")
    assert table.get("sql") is None
    assert table.check(wb.info) == ""
    wb.refused = ""
    assert table.get("sql") is table.get("b")
