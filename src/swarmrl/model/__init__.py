"""swarmrl.model: the char tokenizer, the tiny-model factory, and HF-directory load/save."""

from swarmrl.model.factory import create_tiny_model
from swarmrl.model.io import load_policy, save_policy
from swarmrl.model.tokenizer import build_char_tokenizer

__all__ = ["build_char_tokenizer", "create_tiny_model", "load_policy", "save_policy"]
