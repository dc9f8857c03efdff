"""kvsieve's settings: one pydantic-settings model read from environment
variables (`KVSIEVE_<SECTION>__<FIELD>`) and a YAML file (`--config FILE` or
`KVSIEVE_CONFIG`), validated at start-up.

Precedence: command-line flags > environment > YAML file > defaults. A bad
value stops start-up with a message naming the setting (`limits.max_tokens`)
and the environment variable that sets it.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict, YamlConfigSettingsSource

CONFIG_ENV = "KVSIEVE_CONFIG"
ENV_PREFIX = "KVSIEVE_"
ENV_NESTED = "__"


class _Section(BaseModel):
    # A misspelt key in the YAML file is an error, not a silently ignored line.
    model_config = ConfigDict(extra="forbid")


class EngineConfig(_Section):
    """The SGLang engine each replica (or the single process) owns."""

    model: Optional[str] = Field(None, description="local HF checkpoint directory; default: the embedded SmolLM2-135M-Instruct")
    served_model_name: Optional[str] = None
    device: Literal["cpu", "cuda"] = "cpu"
    dtype: str = "auto"
    context_length: Optional[int] = Field(None, gt=0)
    max_total_tokens: int = Field(65536, gt=0)
    max_running_requests: Optional[int] = Field(None, gt=0)
    max_queued_requests: Optional[int] = Field(None, gt=0)
    chunked_prefill_size: Optional[int] = Field(None, gt=0)
    tp_size: int = Field(1, ge=1, le=64, description="tensor-parallel ranks (kv heads split between them)")
    presets_file: Optional[str] = Field(None, description="JSON file of kv_policy presets (read-only, beside the store's)")
    policy_modules: list[str] = Field(default_factory=list)

    @field_validator("model", "presets_file")
    @classmethod
    def _exists(cls, value: Optional[str]) -> Optional[str]:
        if value is not None and not Path(value).expanduser().exists():
            raise ValueError(f"{value} does not exist")
        return value


class ServerConfig(_Section):
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=1, le=65535)
    log_level: Literal["debug", "info", "warning", "error"] = "warning"


class StoreConfig(_Section):
    """Where presets, calibration artifacts and API keys live."""

    url: str = Field("file://~/.cache/kvsieve/store.json",
                     description="file://PATH (the embedded default) or redis://HOST:PORT/DB")
    refresh_interval_s: float = Field(1.0, gt=0, le=60, description="how often servers poll the store for changes")
    timeout_s: float = Field(0.5, gt=0, le=30, description="per Redis call; past it the store counts as unreachable")

    @field_validator("url")
    @classmethod
    def _scheme(cls, value: str) -> str:
        if not value.startswith(("file://", "redis://", "rediss://", "unix://")):
            raise ValueError("must start with file://, redis://, rediss:// or unix://")
        return value


class AuthConfig(_Section):
    enabled: bool = Field(False, description="require an API key (created with `kvsieve keys create`) on /v1/*")
    default_rate_per_s: float = Field(10.0, gt=0, description="token-bucket refill per key unless the key sets its own")
    default_burst: int = Field(20, gt=0)


class LimitsConfig(_Section):
    """Caps on what one request may ask for; past one: 400 naming the field."""

    max_body_bytes: int = Field(1 << 20, gt=0, description="request body size; larger: 413")
    max_tokens: int = Field(4096, gt=0, description="max_tokens / max_completion_tokens; also the default when a request sets none")
    max_prompt_tokens: Optional[int] = Field(None, gt=0, description="prompt length in tokens (default: the model's context)")
    max_kv_budget: Optional[int] = Field(None, gt=0, description="kv_policy.budget in tokens (default: no cap beyond the context)")
    request_timeout_s: float = Field(600.0, gt=0, description="per request, queueing included; past it: 504 and the request is aborted")


class AutoscalingConfig(_Section):
    min_replicas: int = Field(1, ge=0)
    max_replicas: int = Field(2, ge=1)
    target_ongoing_requests: float = Field(4.0, gt=0)
    upscale_delay_s: float = Field(10.0, ge=0)
    downscale_delay_s: float = Field(60.0, ge=0)
    look_back_period_s: float = Field(30.0, gt=0, description="the autoscaler decides on ongoing requests averaged over this window")

    @model_validator(mode="after")
    def _bounds(self) -> "AutoscalingConfig":
        if self.min_replicas > self.max_replicas:
            raise ValueError(f"min_replicas ({self.min_replicas}) is above max_replicas ({self.max_replicas})")
        return self


class RayConfig(_Section):
    """Ray Serve mode: on when `replicas` or `autoscaling` is set."""

    address: Optional[str] = Field(None, description="existing cluster (ray://host:10001 or auto); none: start Ray in-process")
    replicas: Optional[int] = Field(None, ge=1, description="fixed number of engine replicas")
    autoscaling: Optional[AutoscalingConfig] = None
    num_cpus_per_replica: float = Field(1.0, ge=0)
    num_gpus_per_replica: float = Field(0.0, ge=0)
    max_ongoing_requests: int = Field(32, ge=1, description="per engine replica; past it Serve queues at the ingress")
    graceful_shutdown_timeout_s: float = Field(30.0, ge=0, description="scale-down and stop: requests may finish for this long, then end with a server_shutting_down error")
    health_check_period_s: float = Field(5.0, gt=0)
    app_name: str = "kvsieve"
    ingress_replicas: int = Field(1, ge=1, description="Serve replicas of the ingress (API, guards); rate limits hold across them with a redis:// store")
    engine_resources: dict[str, float] = Field(default_factory=dict, description="custom Ray resources each engine replica reserves, e.g. {kvsieve_engine: 1}: one replica per node that offers one")
    ingress_resources: dict[str, float] = Field(default_factory=dict, description="custom Ray resources of the ingress and metrics hub, e.g. {'node:__internal_head__': 0.001} keeps them on the head node")
    node_ip_address: Optional[str] = Field(None, description="this process's node address in Ray; default: 127.0.0.1 when Ray runs in-process or ray.address is a loopback one (see service/scale/loopback.py)")
    proxy_location: Literal["HeadOnly", "EveryNode"] = Field("HeadOnly", description="where Serve runs its HTTP proxy (server.host:server.port)")
    routing: Literal["pow2", "prefix"] = Field("pow2", description="engine replica choice: Serve's power of two choices, or prefix: by the prompt's first prefix_tokens tokens (service/scale/routing.py)")
    prefix_tokens: int = Field(32, ge=1, description="leading prompt tokens that name a prefix for routing: prefix")

    @model_validator(mode="after")
    def _one_sizing(self) -> "RayConfig":
        if self.replicas is not None and self.autoscaling is not None:
            raise ValueError("set either replicas or autoscaling, not both")
        return self

    @property
    def enabled(self) -> bool:
        return self.replicas is not None or self.autoscaling is not None


class Settings(BaseSettings):
    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX, env_nested_delimiter=ENV_NESTED, extra="forbid", validate_default=True,
    )

    engine: EngineConfig = Field(default_factory=EngineConfig)
    server: ServerConfig = Field(default_factory=ServerConfig)
    store: StoreConfig = Field(default_factory=StoreConfig)
    auth: AuthConfig = Field(default_factory=AuthConfig)
    limits: LimitsConfig = Field(default_factory=LimitsConfig)
    ray: RayConfig = Field(default_factory=RayConfig)

    @classmethod
    def settings_customise_sources(cls, settings_cls, init_settings, env_settings, dotenv_settings, file_secret_settings):
        sources: list[PydanticBaseSettingsSource] = [init_settings, env_settings]
        path = os.environ.get(CONFIG_ENV)
        if path:
            sources.append(YamlConfigSettingsSource(settings_cls, yaml_file=path))
        return tuple(sources)


class ConfigError(ValueError):
    """A setting failed validation; the message names it."""


def _setting_name(loc: tuple) -> str:
    return ".".join(str(p) for p in loc)


def _env_name(loc: tuple) -> str:
    return ENV_PREFIX + ENV_NESTED.join(str(p).upper() for p in loc)


def load_settings(config_file: Optional[str] = None, **overrides: Any) -> Settings:
    """Settings from the environment and the YAML file (`config_file`, else
    $KVSIEVE_CONFIG), with `overrides` ({section: {field: value}}) on top."""
    if config_file is not None:
        if not Path(config_file).is_file():
            raise ConfigError(f"config file {config_file} does not exist")
        os.environ[CONFIG_ENV] = str(Path(config_file).resolve())
    try:
        return Settings(**overrides)
    except ValidationError as exc:
        lines = []
        for err in exc.errors():
            loc = tuple(err["loc"])
            msg = err["msg"].removeprefix("Value error, ")
            lines.append(f"  {_setting_name(loc)}: {msg} (env {_env_name(loc)})")
        source = os.environ.get(CONFIG_ENV)
        head = f"invalid kvsieve settings{f' (file {source})' if source else ''}:"
        raise ConfigError("\n".join([head, *lines])) from None
    except (OSError, ValueError) as exc:  # unreadable or non-YAML file
        raise ConfigError(f"cannot read the kvsieve settings: {exc}") from None
