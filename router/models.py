"""The models a router serves: one tokenizer, chat template and set of generation defaults each.

Contract
- input: `--model` entries `[ID=]SOURCE` (comma-separated); SOURCE is a GGUF file, a Hugging Face
  directory or a hub id (`org/name`, from the local Hugging Face cache; `--allow-download` lets
  the router fetch its tokenizer files). ID defaults to `common.model_files.model_id(SOURCE)`, the
  same rule a worker without --served-model-name reports itself by. No entry = the embedded model.
- output: `ModelTable`: `ids()`, `get(id)` -> `ServedModel` (tokenizer, fingerprint, defaults);
  `check(WorkerInfo)` -> "" when the router may route to that worker, else the reason it may not
  (a model it does not serve, no fingerprint, or a fingerprint that differs from the router's
  tokenizer for that model; a worker's LoRA adapters, WorkerInfo.adapters, become ids `get` resolves
  to their base model, unless one collides with a served model or another base's adapter);
  `apply_defaults(req, sampling)` fills the sampling fields a request
  left unset from the model's generation defaults (generation_config.json, or a GGUF's documented
  defaults: `common.model_files.generation_defaults`); `worker_states(registry)` -> the JSON the
  router serves at /workers (each worker's model, health and why it is refused).
- state: the models are read-only after construction; the adapter ids grow as workers are vetted.
- failure modes: a SOURCE that does not resolve or a vocabulary the router cannot build ->
  `SystemExit` at start-up naming the entry; two entries with one id -> `SystemExit`.
- proven by: tests/test_models_e2e.py (three models behind one router, a worker with a
  mismatched tokenizer refused, unknown model INVALID_ARGUMENT, defaults applied),
  tests/test_models_unit.py.
"""

from __future__ import annotations

import dataclasses
import logging
import pathlib
from collections.abc import Callable, Iterable

from common.model_files import generation_defaults, model_id, resolve_model_source
from common.tokenizer import Fingerprint, Tokenizer
from protos.llm.v1 import generation_pb2 as pb
from protos.llm.v1 import worker_pb2
from router.validation import ValidRequest

log = logging.getLogger(__name__)
_REQUEST_FIELDS = {f.name for f in dataclasses.fields(ValidRequest)}


@dataclasses.dataclass(frozen=True)
class ServedModel:
    id: str
    source: str  # as given on the command line ("" = the embedded model)
    path: pathlib.Path
    tokenizer: Tokenizer
    defaults: dict[str, float]

    @property
    def fingerprint(self) -> Fingerprint:
        return self.tokenizer.fingerprint


def parse_entry(entry: str) -> tuple[str, str]:
    """`ID=SOURCE` -> (ID, SOURCE); `SOURCE` -> ("", SOURCE)."""
    name, sep, source = entry.partition("=")
    return (name.strip(), source.strip()) if sep else ("", entry.strip())


def load_model(entry: str, allow_download: bool = False) -> ServedModel:
    name, source = parse_entry(entry)
    try:
        path = resolve_model_source(source or None, allow_download=allow_download, tokenizer_only=True)
        tokenizer = Tokenizer.from_model(path)
        tokenizer.byte_table  # built here, at start-up off the event loop, not by the first request
        tokenizer.prepare_chat()  # (the same for the copy that keeps control-token text in messages text)
        return ServedModel(
            name or model_id(source or None, path), source, path, tokenizer, generation_defaults(path)
        )
    except (OSError, ValueError, KeyError) as exc:
        raise SystemExit(f"--model {entry!r}: {exc}") from None


def fingerprint_of(info: worker_pb2.WorkerInfo) -> Fingerprint | None:
    if not info.HasField("tokenizer"):
        return None
    t = info.tokenizer
    return Fingerprint(t.vocab_size, tuple(t.eos_token_ids), t.vocab_sha256)


class ModelTable:
    def __init__(self, models: Iterable[ServedModel]):
        self._models: dict[str, ServedModel] = {}
        # LoRA adapters, set by the router (router/server.py): `live()` the registry's healthy
        # workers' models (a ModelSpec per id, an adapter's with its base), `claimed()` adapter ->
        # the base models of every vetted worker that reports it, healthy or not (its workers down:
        # the request waits or gets UNAVAILABLE, as a base model's would; no worker reports it
        # any more: an unknown model)
        self.live: Callable[[], dict] = dict
        self.claimed: Callable[[], dict[str, set[str]]] = dict
        for m in models:
            if m.id in self._models:
                raise SystemExit(f"--model: two entries serve the id {m.id!r}; give one of them ID=...")
            self._models[m.id] = m

    @classmethod
    def from_entries(cls, entries: Iterable[str], allow_download: bool = False) -> ModelTable:
        table = cls(load_model(e, allow_download) for e in (tuple(entries) or ("",)))
        for m in table._models.values():
            log.info(
                "model %s from %s: tokenizer %s; generation defaults %s",
                m.id,
                m.path,
                m.fingerprint.describe(),
                m.defaults or "none",
            )
        return table

    def ids(self) -> list[str]:
        return sorted(self._models)

    def get(self, model: str) -> ServedModel | None:
        """The served model `model` names: a base model, or a LoRA adapter's base (its tokenizer,
        template and defaults are the base model's)."""
        served = self._models.get(model)
        if served is None:
            spec = self.live().get(model)
            if spec is not None and spec.base:
                return self._models.get(spec.base)
            bases = self.claimed().get(model, ())
            served = self._models.get(next(iter(bases))) if len(bases) == 1 else None
        return served

    def base_id(self, model: str) -> str:
        """The id of the base model `model` names (itself for a base model or an unknown id)."""
        served = self.get(model)
        return served.id if served is not None else model

    def tokenizer(self, model: str) -> Tokenizer:
        served = self.get(model)
        if served is None:
            raise KeyError(model)
        return served.tokenizer

    def decoder(self, model: str):
        """token ids -> their text in `model`'s vocabulary (the OpenAI front's logprobs and echo)."""
        return self.tokenizer(model).decode

    def check(self, info: worker_pb2.WorkerInfo) -> str:
        """ "" when a worker reporting `info` may serve requests routed by this router."""
        served = self._models.get(info.model)
        if served is None:
            return f"serves model {info.model!r}, which this router does not (it serves {self.ids()})"
        theirs = fingerprint_of(info)
        if theirs is None:
            return f"reports no tokenizer fingerprint for model {info.model!r}"
        if theirs != served.fingerprint:
            return (
                f"tokenizer fingerprint for model {info.model!r} differs from the router's "
                f"(worker: {theirs.describe()}; router: {served.fingerprint.describe()})"
            )
        for adapter in info.adapters:  # LoRA adapters: served as models of their own
            if adapter in self._models:
                return f"serves a LoRA adapter under the id of a served model, {adapter!r}"
            others = sorted(self.claimed().get(adapter, set()) - {info.model})  # any worker's, up or down
            if others:
                return f"serves LoRA adapter {adapter!r} of {info.model!r}; other workers, of {others[0]!r}"
        return ""

    def apply_defaults(self, req: ValidRequest, sampling: pb.SamplingParams) -> ValidRequest:
        """The model's generation defaults for every sampling field the request left unset."""
        served = self.get(req.model.name)
        if served is None or not served.defaults:
            return req
        changes = {}
        for key, value in served.defaults.items():
            if key not in _REQUEST_FIELDS or _is_set(sampling, key):
                continue
            if key == "top_k" and not 0 <= int(value) <= req.model.vocab_size:
                continue
            changes[key] = type(getattr(req, key))(value)
        return dataclasses.replace(req, **changes) if changes else req


def _is_set(sampling: pb.SamplingParams, key: str) -> bool:
    field = sampling.DESCRIPTOR.fields_by_name.get(key)
    if field is None:
        return False
    if field.has_presence:
        return sampling.HasField(key)
    return getattr(sampling, key) != field.default_value


def worker_states(registry) -> list[dict]:
    """Every known worker: address, model, healthy, and why the router refuses it ("" = it does not)."""
    return [
        {
            "worker": h.address,
            "model": h.info.model if h.info is not None else "",
            "healthy": h.healthy,
            "refused": h.refused,
            "last_error": h.last_error,
        }
        for h in registry.all()
    ]


def entries_for(model: str | None, served_model_name: str | None) -> tuple[str, ...]:
    """The router `--model` entries that match workers started with these --model and
    --served-model-name values (the launchers start both from one set of flags)."""
    if served_model_name:
        return (f"{served_model_name}={model or ''}",)
    return (model,) if model else ()
