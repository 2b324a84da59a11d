"""Configuration of the proxy: one pydantic-settings object, environment prefix `TRAJSTORE_`."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from trajstore.proxy.images import DEFAULT_MAX_IMAGE_BYTES, MAX_STORABLE_IMAGE_BYTES


class ProxySettings(BaseSettings):
    """How the proxy listens, which engines it serves from, and its limits."""

    model_config = SettingsConfigDict(env_prefix="TRAJSTORE_", extra="ignore")

    engines: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="Engine base URLs (vLLM OpenAI servers); env: comma-separated.",
    )
    host: str = Field(default="127.0.0.1", description="Address to listen on.")
    port: int = Field(default=8400, ge=0, le=65535, description="Port to listen on.")
    public_url: str | None = Field(
        default=None, description="URL agents reach the proxy at (default: http://HOST:PORT)."
    )
    api_key: str | None = Field(
        default=None,
        description="The admin key: when set, creating sessions and admin calls need it as a "
        "Bearer token (rewards, finishes and discards take it or the session's orchestrator key).",
    )
    session_secret: str | None = Field(
        default=None,
        description="Secret that derives per-session API keys; share it between replicas "
        "(default: TRAJSTORE_API_KEY, else random per process).",
    )
    engine_api_key: str | None = Field(
        default=None, description="Bearer token the engines want (vLLM --api-key), if any."
    )
    policy_version: str = Field(default="0", description="Initial policy version of engines.")
    logprobs_mode: str = Field(
        default="raw_logprobs",
        description="What the engines' logprobs mean (vLLM --logprobs-mode), recorded per turn.",
    )
    max_body_bytes: int = Field(default=8 * 1024 * 1024, description="Largest request body.")
    max_image_bytes: int = Field(
        default=DEFAULT_MAX_IMAGE_BYTES,
        ge=1,
        le=MAX_STORABLE_IMAGE_BYTES,
        description="Largest image (decoded) a chat message may carry as a data URL; a larger "
        "one is a 413 (`proxy.images`; at most what one event can store).",
    )
    image_token_id: int | None = Field(
        default=None,
        ge=0,
        description="The engines' image placeholder token id (Qwen2-VL and Qwen2.5-VL: 151655, "
        "LLaVA-1.5: 32000; the model's `image_token_id` or `image_token_index`), recorded with "
        "requests that carry images so that samples locate each image's placeholder ids.",
    )
    request_timeout: float = Field(
        default=600.0, description="Seconds an engine may take (between stream chunks)."
    )
    max_in_flight: int = Field(default=256, description="Requests per engine before fallback.")
    switch_hold_timeout: float = Field(
        default=120.0,
        gt=0,
        description="Seconds a new request waits for its engine's weight switch to end before "
        "it is refused with 503; a switch with no word (live or failed) within twice this is given "
        "up and recorded as failed (`proxy.switching`).",
    )
    switch_cut_timeout: float = Field(
        default=60.0,
        gt=0,
        description="Seconds a switch waits for its engines' requests in flight to be cut.",
    )
    chunk_tokens: int = Field(
        default=16, description="Streamed tokens coalesced into one completion_chunk event."
    )
    writer_max_pending: int = Field(
        default=200_000, description="Events the recorder may hold before refusing requests."
    )
    writer_linger: float = Field(
        default=0.1,
        gt=0,
        le=5,
        description="Seconds the recorder waits to gather events into one transaction "
        "(a full batch and `finish` never wait for it).",
    )

    hosted_tools: Literal["drop", "refuse"] = Field(
        default="drop",
        description="What a Responses or Messages request's tools that the engine cannot run "
        "(hosted and server tools: web_search, file_search, code_interpreter, mcp, ...) become: "
        "`drop`, left out of what the engine sees, recorded with the turn (`dropped_tools`) and "
        "named in the X-Trajstore-Dropped-Tools header; `refuse`, a 400 naming the tool.",
    )
    continuation: Literal["tokens", "text"] = Field(
        default="tokens",
        description="How a chat turn that continues an earlier turn of its lineage reaches the "
        "engine: `tokens`, the ids already sampled plus the new messages' (no retokenisation "
        "drift; see proxy.continuation), or `text`, the messages rendered by the engine.",
    )
    continuation_audit_every: int = Field(
        default=16,
        ge=0,
        description="A continued turn's check renders only the new messages; on a lineage's "
        "first continued turn, then after this many continued turns (once the conversation "
        "also grew by TRAJSTORE_CONTINUATION_AUDIT_GROWTH), the whole conversation is rendered "
        "too: an audit that turns continuation off for the lineage when it disagrees, and that "
        "measures the drift avoided (1 with growth 0: every turn; 0: never).",
    )
    continuation_audit_growth: float = Field(
        default=0.5,
        ge=0,
        description="How much a conversation must have grown since its last audit before the "
        "next (0.5: by half), so that audits cost a flat share of each turn at any length.",
    )
    context_bytes: int = Field(
        default=256 << 20,
        ge=1 << 20,
        description="Bytes of the sessions' remembered turns (what token-in continuation and "
        "prompts stored as references need) a replica keeps; past it, the least recently used "
        "sessions go first, and one session keeps at most half of it (its oldest turns go "
        "first). What went is read back from the log when a request needs it.",
    )
    reader_max_bytes: int = Field(
        default=1 << 30,
        ge=64 << 20,
        description="Resident bytes past which the process that answers session reads "
        "(`GET /sessions/{id}`, `proxy.reader`) is replaced by a fresh one; the reads never "
        "grow the recording proxy itself.",
    )
    reader_idle_timeout: float = Field(
        default=120.0,
        gt=0,
        description="Seconds without a session read after which the reader process exits, its "
        "memory back to the system (the next read starts another, about a second).",
    )
    session_idle_timeout: float = Field(
        default=3600.0,
        ge=0,
        description="Seconds without any event after which an active session is finished as "
        "`timeout` (0: never).",
    )
    replica_lost_after: float = Field(
        default=60.0,
        gt=0,
        description="Seconds a proxy replica must be gone (its connections absent) before the "
        "requests it left open are recorded as failed (`replica_lost`); keep it above a "
        "writer's 30 s of retries.",
    )
    reap_interval: float = Field(
        default=10.0,
        gt=0,
        description="Seconds between two looks for lost requests and idle sessions.",
    )
    finish_timeout: float = Field(
        default=30.0,
        gt=0,
        description="Seconds `finish` waits for the other replicas to store the session's events "
        "before answering 503 (retry it).",
    )
    admission_max_in_flight: int | None = Field(
        default=None,
        ge=1,
        description="Model requests this replica serves at once across all runs; the rest wait, "
        "served one run at a time in turn so no run's burst starves another's "
        "(`proxy.admission`; unset: no cap, only the runs' own limits apply).",
    )
    admission_max_queued: int | None = Field(
        default=None,
        ge=0,
        description="Requests a run may have waiting on this replica when its limits set no "
        "max_queued; one more is a 429 with Retry-After (unset: no bound).",
    )
    relay_tokens: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="Tokens that let a relay (`trajstore relay`) dial in at /engines/connect, "
        "besides the admin key; env: comma-separated. With neither set, any relay may.",
    )

    tracing: Literal["off", "otlp"] = Field(
        default="off",
        description="`otlp`: every model call as an OpenTelemetry GenAI span, one trace per "
        "session, exported over OTLP in the background (`proxy.tracing`); where and how say the "
        "standard OTEL_EXPORTER_OTLP_ENDPOINT, OTEL_EXPORTER_OTLP_PROTOCOL (http/protobuf or "
        "grpc), OTEL_SERVICE_NAME, ... variables. Needs `pip install 'trajstore[observe]'`.",
    )
    tracing_content: bool = Field(
        default=False,
        description="Put each call's messages and replies into its span "
        "(gen_ai.input.messages, gen_ai.output.messages); off: counts and ids only.",
    )
    viewer_url: str | None = Field(
        default=None,
        description="Where people reach the trajectory viewer (`trajstore ui`): each span links "
        "to its turn's page there (trajstore.viewer.url).",
    )

    @field_validator("relay_tokens", mode="before")
    @classmethod
    def _split_relay_tokens(cls, value: object) -> object:
        if isinstance(value, str):
            return [token.strip() for token in value.split(",") if token.strip()]
        return value

    @field_validator("engines", mode="before")
    @classmethod
    def _split_engines(cls, value: object) -> object:
        if isinstance(value, str):
            return [url.strip() for url in value.split(",") if url.strip()]
        return value
