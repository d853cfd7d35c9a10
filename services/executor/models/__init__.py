from .loader import load_model
from .spec import ModelSpec
from .transformer import CausalLM

__all__ = ["CausalLM", "ModelSpec", "load_model"]
