"""Held-out evaluation with ``eval.n`` larger than the held-out split: evaluated whole, and
said once, with both numbers."""

import logging

import torch

from swarmrl.config.model import TinyModelConfig
from swarmrl.config.rl import SamplingConfig
from swarmrl.envs import ArithEnv
from swarmrl.inference.engine import TorchEngine
from swarmrl.model import build_char_tokenizer, create_tiny_model
from swarmrl.trainer.evaluate import evaluate


def test_a_held_out_split_smaller_than_eval_n_is_said_once(caplog):
    env = ArithEnv(1, 0.1)  # 100 problems, 10 held out
    tokenizer = build_char_tokenizer(env.alphabet)
    torch.manual_seed(0)
    tiny = TinyModelConfig(hidden_size=16, num_layers=1, num_heads=2, intermediate_size=32)
    engine = TorchEngine(create_tiny_model(tiny, tokenizer), tokenizer)
    sampling = SamplingConfig(max_new_tokens=2)
    with caplog.at_level(logging.WARNING, logger="swarmrl.trainer.evaluate"):
        first = evaluate(env, engine, tokenizer, 500, 1, sampling, 0)
        evaluate(env, engine, tokenizer, 500, 1, sampling, 0)
    assert first["n"] == 10
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "eval.n = 500" in warnings[0] and "has 10 problems" in warnings[0]
