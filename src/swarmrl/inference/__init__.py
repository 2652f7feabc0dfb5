"""swarmrl.inference: the batched PyTorch engine and its seeded Gumbel-max sampling."""

from swarmrl.inference.engine import TorchEngine
from swarmrl.inference.sampling import gumbel_noise, sample_tokens
from swarmrl.inference.types import Generation, Prefill

__all__ = [
    "Generation",
    "Prefill",
    "TorchEngine",
    "gumbel_noise",
    "sample_tokens",
]
