"""`python -m services.gateway`: the gRPC API of a Tandem cluster."""

import asyncio
import logging
import resource
import sys
from contextlib import AsyncExitStack
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2_grpc

from services.gateway.clients import ClientKeys, TrustedProxies
from services.gateway.direct_rooms import DirectRooms
from services.gateway.grpc_bounds import CallBounds, server_options
from services.gateway.health import ReadinessProbe
from services.gateway.holdings_exchange import HoldingsExchange
from services.gateway.http_api import OpenAIApi
from services.gateway.http_connections import ConnectionBounds, ConnectionWatch
from services.gateway.http_server import HttpServer, ssl_context
from services.gateway.prompt_tokenizer import PromptTokenizer
from services.gateway.sampling_defaults import SamplingDefaults
from services.gateway.schedulers import SchedulerPool
from services.gateway.servicer import TandemServicer, add_to_server, default_policy
from services.gateway.settings import GatewaySettings
from services.gateway.streams import StreamRouter
from services.gateway.validation import Limits, max_prompt_chars, message_tokens
from shared import model_store
from shared.control.bus import BusTiming, NatsBus
from shared.control.liveness import Liveness
from shared.control.subjects import Subjects
from shared.lifecycle import stop_on_signals
from shared.settings import (
    load_settings,
    nats_options,
    setup_interpreter,
    setup_logging,
    started,
)
from shared.telemetry.metrics import MetricsServer
from shared.telemetry.tracing import start_tracing

log = logging.getLogger("gateway")
FD_HEADROOM = 256  # open files beside the API connections: NATS, logs, the tokenizer's files


def load_tokenizer(settings: GatewaySettings):
    return model_store.load_tokenizer(model_store.prepare(settings.model, settings.model_cache))


def limits_of(settings: GatewaySettings, tokenizer) -> Limits:
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(tokenizer.name_or_path)
    model_limit = model_store.context_limit(config)
    max_model_len = min(settings.max_model_len or model_limit, model_limit)
    return Limits(
        max_model_len=max_model_len,
        default_max_tokens=settings.default_max_tokens,
        max_tokens_limit=settings.max_tokens_limit,
        max_stop_strings=settings.max_stop_strings,
        max_prompt_tokens=settings.max_prompt_tokens,
        max_prompt_chars=max_prompt_chars(tokenizer, settings.max_prompt_tokens or max_model_len),
        message_tokens=message_tokens(PromptTokenizer(tokenizer)),
    )


def listen(server: grpc.aio.Server, settings: GatewaySettings) -> int:
    """Binds the gRPC port: TLS when a certificate is set (client certificates when a client CA
    is), plaintext otherwise; the port actually bound."""
    address = f"{settings.grpc_host}:{settings.grpc_port}"
    if not settings.grpc_tls_cert:
        return server.add_insecure_port(address)
    client_ca = (
        Path(settings.grpc_tls_client_ca).read_bytes() if settings.grpc_tls_client_ca else None
    )
    key_and_cert = (
        Path(settings.grpc_tls_key).read_bytes(),
        Path(settings.grpc_tls_cert).read_bytes(),
    )
    credentials = grpc.ssl_server_credentials(
        [key_and_cert], root_certificates=client_ca, require_client_auth=client_ca is not None
    )
    return server.add_secure_port(address, credentials)


def grpc_server(
    settings: GatewaySettings, servicer: TandemServicer
) -> tuple[grpc.aio.Server, health.aio.HealthServicer]:
    """The gRPC server with the Tandem API and the health service (its status still unset)."""
    server = grpc.aio.server(
        options=server_options(settings),
        interceptors=[CallBounds(settings.read_timeout_s, settings.write_timeout_s)],
        maximum_concurrent_rpcs=settings.grpc_max_concurrent_rpcs,
    )
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    add_to_server(servicer, server)
    return server, health_servicer


def transport_of(settings: GatewaySettings) -> str:
    if not settings.grpc_tls_cert:
        return "plaintext"
    return "TLS" + (" with client certificates" if settings.grpc_tls_client_ca else "")


async def servicer_of(settings: GatewaySettings, tokenizer, stack: AsyncExitStack):
    """The API's servicer and its bus, with the bus's watchers entered on `stack`."""
    subjects = Subjects(settings.cluster)
    tracing = start_tracing("tandem-gateway", settings.otlp_endpoint)
    stack.callback(tracing.shutdown)
    bus = await stack.enter_async_context(
        NatsBus(
            settings.nats_url,
            settings.gateway_id,
            nats_options(settings),
            role="gateway",
            cluster=settings.cluster,
            tracing=tracing.enabled,
            timing=BusTiming(
                settings.nats_connect_timeout_s,
                settings.nats_ping_interval_s,
                settings.nats_reconnect_wait_s,
                settings.nats_drain_timeout_s,
            ),
        )
    )
    streams = await stack.enter_async_context(
        StreamRouter(bus, subjects.gateway_tokens(settings.gateway_id))
    )
    liveness = await stack.enter_async_context(Liveness(bus, subjects, settings.worker_timeout_s))
    rooms = DirectRooms(settings.direct_placement, settings.room_fresh_s)
    schedulers = await stack.enter_async_context(
        SchedulerPool(bus, subjects, settings.worker_timeout_s, rooms)
    )
    proxies = TrustedProxies.parse(settings.trusted_proxies)
    keys = ClientKeys.load(settings.api_keys_file, default_policy(settings), proxies)
    limits = limits_of(settings, tokenizer)
    servicer = TandemServicer(settings, bus, streams, tokenizer, limits, liveness, schedulers, keys)
    await stack.enter_async_context(
        HoldingsExchange(
            bus, subjects, settings.gateway_id, servicer.seats, settings.holdings_interval_s
        )
    )
    return servicer


def served_model_name(settings: GatewaySettings) -> str:
    """The model's name in the HTTP API: set, or its file (or directory) name."""
    if settings.served_model_name:
        return settings.served_model_name
    return model_store.resolve(settings.model).name.removesuffix(".gguf")


def openai_api(settings: GatewaySettings, servicer: TandemServicer, probe) -> OpenAIApi:
    """The OpenAI API's routes, with the model's generation config as their sampling defaults."""
    return OpenAIApi(
        servicer,
        servicer.tokenizer,
        served_model_name(settings),
        lambda: probe.serving,
        settings.max_request_bytes,
        SamplingDefaults.of(Path(servicer.tokenizer.name_or_path)),
    )


def http_server(settings: GatewaySettings, servicer: TandemServicer, probe) -> HttpServer:
    api = openai_api(settings, servicer, probe)
    tls = ssl_context(settings.grpc_tls_cert, settings.grpc_tls_key, settings.grpc_tls_client_ca)
    bounds = ConnectionBounds(
        read_timeout_s=settings.read_timeout_s,
        idle_timeout_s=settings.http_idle_timeout_s,
        write_timeout_s=settings.write_timeout_s,
        max_connections=settings.http_max_connections,
        linger_s=settings.http_linger_s,
        send_buffer_bytes=settings.http_send_buffer_bytes,
    )
    watch = ConnectionWatch(servicer.metrics.registry, servicer.metrics.ids)
    address = (settings.http_host, settings.http_port)
    return HttpServer(
        api.app(), *address, tls, settings.drain_timeout_s, bounds, watch, settings.reuse_port
    )


def raise_fd_limit(settings: GatewaySettings) -> None:
    """Open files enough for both fronts' connection caps (the soft limit is often 1024), up
    to the hard limit; a warning where even that is short."""
    needed = settings.http_max_connections + settings.grpc_max_connections + FD_HEADROOM
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    limit = needed if hard == resource.RLIM_INFINITY else min(needed, hard)
    if soft != resource.RLIM_INFINITY and soft < limit:
        resource.setrlimit(resource.RLIMIT_NOFILE, (limit, hard))
    if limit < needed:
        log.warning(
            "open files are limited to %d; the connection caps (%d HTTP, %d gRPC) need about %d",
            hard,
            settings.http_max_connections,
            settings.grpc_max_connections,
            needed,
        )


async def run(settings: GatewaySettings) -> None:
    stop = stop_on_signals()
    raise_fd_limit(settings)
    tokenizer = await asyncio.to_thread(load_tokenizer, settings)
    async with AsyncExitStack() as stack:
        servicer = await servicer_of(settings, tokenizer, stack)
        server, health_servicer = grpc_server(settings, servicer)
        stack.enter_context(
            MetricsServer(servicer.metrics.registry, settings.metrics_host, settings.metrics_port)
        )
        port = listen(server, settings)
        started()  # before any request comes: a collection now would hold its first answers
        await server.start()
        log.info(
            "%s listening on %s:%d (%s, cluster %r)",
            settings.gateway_id,
            settings.grpc_host,
            port,
            transport_of(settings),
            settings.cluster,
        )
        http = None
        try:
            async with ReadinessProbe(servicer.bus, servicer.subjects, health_servicer) as probe:
                if settings.http_port >= 0:
                    http = await http_server(settings, servicer, probe).start()
                    log.info("OpenAI-compatible HTTP API on %s:%d", settings.http_host, http.port)
                await stop.wait()
                log.info(
                    "stopping: no new requests; streams in flight get up to %.0fs",
                    settings.drain_timeout_s,
                )
        finally:  # both APIs drain at once
            await asyncio.gather(
                server.stop(grace=settings.drain_timeout_s), *([http.stop()] if http else [])
            )
        log.info("stopped")


def main(argv=None) -> int:
    settings = load_settings(GatewaySettings, argv, prog="python -m services.gateway")
    setup_logging(settings.log_level, "gateway")
    setup_interpreter(settings)
    asyncio.run(run(settings))
    return 0


if __name__ == "__main__":
    sys.exit(main())
