"""The root of the config tree: one section per subsystem."""

from __future__ import annotations

from pydantic import Field, model_validator

from swarmrl.config.base import Section
from swarmrl.config.env import EnvConfig
from swarmrl.config.inference import InferenceConfig
from swarmrl.config.log import LogConfig
from swarmrl.config.model import ModelConfig
from swarmrl.config.pool import PoolConfig
from swarmrl.config.rl import EvalConfig, RLConfig, SFTConfig
from swarmrl.config.run import RunConfig
from swarmrl.config.shardcast import ShardcastConfig
from swarmrl.config.swarm import SwarmSection
from swarmrl.config.toploc import ToplocConfig
from swarmrl.config.trainer import TrainerConfig


class SwarmConfig(Section):
    """Everything a run needs; ``swarmrl run CONFIG`` validates a TOML file against this."""

    run: RunConfig = Field(default_factory=RunConfig)
    model: ModelConfig = Field(default_factory=ModelConfig)
    env: EnvConfig = Field(default_factory=EnvConfig)
    rl: RLConfig = Field(default_factory=RLConfig)
    trainer: TrainerConfig = Field(default_factory=TrainerConfig)
    sft: SFTConfig = Field(default_factory=SFTConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    inference: InferenceConfig = Field(default_factory=InferenceConfig)
    toploc: ToplocConfig = Field(default_factory=ToplocConfig)
    shardcast: ShardcastConfig = Field(default_factory=ShardcastConfig)
    pool: PoolConfig = Field(default_factory=PoolConfig)
    swarm: SwarmSection = Field(default_factory=SwarmSection)
    log: LogConfig = Field(default_factory=LogConfig)

    @property
    def engine_dtype(self) -> str:
        """The dtype the policy generates and is replayed in: ``inference.dtype``, else the
        trainer's ``model.dtype``."""
        return self.inference.dtype or self.model.dtype

    @property
    def pool_engines(self) -> list[str]:
        """The engines the pool accepts and the verifier is calibrated across:
        ``toploc.engines``, else ``inference.backend`` alone."""
        return list(self.toploc.engines) or [self.inference.backend]

    @model_validator(mode="after")
    def _own_engine_accepted(self) -> SwarmConfig:
        engines = self.toploc.engines
        if engines and self.inference.backend not in engines:
            raise ValueError(
                f"inference.backend {self.inference.backend!r} is not among toploc.engines "
                f"{list(engines)}: the run's own workers and validators would use an engine "
                "its pool refuses"
            )
        return self
