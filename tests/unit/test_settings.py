"""load_settings: flag > TANDEM_* variable > default; bad input exits 2 like any argparse error."""

import gc
import weakref

import pytest

from services.decode.settings import DecodeSettings
from services.gateway.settings import GatewaySettings
from services.scheduler.settings import SchedulerSettings
from shared import settings
from shared.control.worker_roles import Mode, Role
from shared.settings import load_settings


def test_defaults_with_no_flags_and_no_env():
    s = load_settings(SchedulerSettings, [], env={})
    assert (s.mode, s.worker_timeout_s, s.cluster, s.nats_url) == (
        "auto",
        3.0,
        "default",
        "nats://127.0.0.1:4222",
    )


def test_env_beats_default_and_flag_beats_env():
    env = {
        "TANDEM_MODE": "colocated",
        "TANDEM_WORKER_TIMEOUT_S": "7.5",
        "TANDEM_CLUSTER": "from-env",
    }
    s = load_settings(SchedulerSettings, ["--cluster", "from_flag"], env=env)
    assert s.mode == "colocated"
    assert s.worker_timeout_s == 7.5
    assert s.cluster == "from_flag"


def test_int_fields_are_converted():
    s = load_settings(
        GatewaySettings,
        ["--grpc-port", "6000"],
        env={"TANDEM_MAX_TOKENS_LIMIT": "100", "TANDEM_DEFAULT_MAX_TOKENS": "50"},
    )
    assert (s.grpc_port, s.max_tokens_limit, s.default_max_tokens) == (6000, 100, 50)
    assert s.gateway_id.startswith("gateway-")


def test_unrelated_env_is_ignored():
    s = load_settings(SchedulerSettings, [], env={"MODE": "colocated", "tandem_mode": "colocated"})
    assert s.mode == "auto"


@pytest.mark.parametrize(
    "argv, env, expected",
    [
        ([], {}, False),
        (["--colocated"], {}, True),
        ([], {"TANDEM_COLOCATED": "1"}, True),
        ([], {"TANDEM_COLOCATED": "true"}, True),
        ([], {"TANDEM_COLOCATED": "false"}, False),
        ([], {"TANDEM_COLOCATED": "0"}, False),
        (["--no-colocated"], {"TANDEM_COLOCATED": "1"}, False),
        (["--colocated"], {"TANDEM_COLOCATED": "false"}, True),
    ],
)
def test_bool_flags_and_env(argv, env, expected):
    s = load_settings(DecodeSettings, argv, env=env)
    assert s.colocated is expected
    assert s.role is (Role.COLOCATED if expected else Role.DECODE)


@pytest.mark.parametrize(
    "cls, argv, env",
    [
        (SchedulerSettings, [], {"TANDEM_WORKER_TIMEOUT_S": "soon"}),
        (GatewaySettings, [], {"TANDEM_GRPC_PORT": "eighty"}),
        (GatewaySettings, [], {"TANDEM_GRPC_PORT": "1.5"}),
        (GatewaySettings, ["--grpc-port", "x"], {}),
        (GatewaySettings, ["--grpc-port", "70000"], {}),
        (DecodeSettings, [], {"TANDEM_COLOCATED": "maybe"}),
        (DecodeSettings, [], {"TANDEM_BLOCK_SIZE": "0"}),
        (SchedulerSettings, ["--mode", "sideways"], {}),
        (SchedulerSettings, [], {"TANDEM_MODE": "Colocated"}),
        (SchedulerSettings, ["--max-itl-ms", "-1"], {}),
        (GatewaySettings, ["--gateway-id", "gw.1"], {}),  # not one NATS subject token
        (GatewaySettings, ["--max-migrations", "17"], {}),
        (GatewaySettings, ["--grpc-tls-cert", "c.pem"], {}),  # without its key
        (SchedulerSettings, [], {"TANDEM_MAX_ITL_MS": "nan"}),
        (SchedulerSettings, ["--no-such-flag"], {}),
    ],
)
def test_bad_input_exits_2(cls, argv, env, capsys):
    with pytest.raises(SystemExit) as exc:
        load_settings(cls, argv, env=env, prog="test")
    assert exc.value.code == 2
    assert "error" in capsys.readouterr().err


@pytest.mark.parametrize("mode", list(Mode), ids=str)
def test_the_mode_is_a_member_from_a_flag_a_variable_or_the_constructor(mode):
    from_flag = load_settings(SchedulerSettings, ["--mode", mode.value], env={})
    from_env = load_settings(SchedulerSettings, [], env={"TANDEM_MODE": mode.value})
    built = SchedulerSettings(mode=mode.value)
    assert from_flag.mode is from_env.mode is built.mode is built.policy().mode is mode


def test_the_mode_flag_offers_the_modes_and_names_them_when_refused(capsys):
    with pytest.raises(SystemExit):
        load_settings(SchedulerSettings, [], env={"TANDEM_MODE": "both"}, prog="test")
    assert "mode: expected one of auto, disaggregated, colocated, got 'both'" in (
        capsys.readouterr().err
    )
    with pytest.raises(ValueError, match="mode must be one of auto, disaggregated, colocated"):
        SchedulerSettings(mode="both")


@pytest.mark.parametrize("cluster", ["prod", "a_b-C9", "x" * 64])
def test_valid_cluster_names(cluster):
    assert load_settings(SchedulerSettings, [], env={"TANDEM_CLUSTER": cluster}).cluster == cluster


@pytest.mark.parametrize("cluster", ["", "a.b", "a b", "a*", ">", "x" * 65, "é"])
def test_invalid_cluster_names(cluster):
    with pytest.raises(SystemExit) as exc:
        load_settings(SchedulerSettings, ["--cluster", cluster], env={})
    assert exc.value.code == 2
    with pytest.raises(ValueError):
        SchedulerSettings(cluster=cluster)


def test_cluster_name_with_trailing_newline_is_rejected():
    with pytest.raises(ValueError):
        SchedulerSettings(cluster="prod\n")


def test_nats_url_may_name_every_node_of_a_cluster():
    """Before, one URL only: a client whose server died had nowhere else to go."""
    from shared.control.bus import NatsBus, server_urls

    urls = "nats://10.0.0.1:4222, nats://10.0.0.2:4222,tls://u:p@10.0.0.3:4222"
    s = load_settings(SchedulerSettings, [], env={"TANDEM_NATS_URL": urls})
    assert server_urls(s.nats_url) == [
        "nats://10.0.0.1:4222",
        "nats://10.0.0.2:4222",
        "tls://u:p@10.0.0.3:4222",
    ]
    assert NatsBus(s.nats_url, "n")._shown_url == (
        "nats://10.0.0.1:4222,nats://10.0.0.2:4222,tls://10.0.0.3:4222"  # no password in logs
    )
    assert server_urls("nats://127.0.0.1:4222") == ["nats://127.0.0.1:4222"]


@pytest.mark.parametrize("url", ["", "nats://a:4222,", "nats://a:4222,,nats://b:4222", " "])
def test_an_empty_nats_url_in_the_list_is_refused(url):
    with pytest.raises(SystemExit) as exc:
        load_settings(SchedulerSettings, ["--nats-url", url], env={})
    assert exc.value.code == 2


def test_each_scheduler_replica_has_an_id_of_its_own_from_the_start():
    """Its NATS connection is named by it (which replica is where, in NATS's monitoring)."""
    first, second = SchedulerSettings(), SchedulerSettings()
    assert first.scheduler_id.startswith("scheduler-") and first.scheduler_id != second.scheduler_id
    assert SchedulerSettings(scheduler_id="s1").scheduler_id == "s1"


def test_nan_timeout_is_rejected():
    with pytest.raises(SystemExit):
        load_settings(SchedulerSettings, [], env={"TANDEM_WORKER_TIMEOUT_S": "nan"})


def test_a_gateway_off_loopback_needs_tls_or_allow_plaintext():
    """Before, a gateway bound 0.0.0.0 without TLS started, prompts and keys in the clear."""
    from services.gateway.settings import GatewaySettings

    with pytest.raises(ValueError, match="loopback"):
        GatewaySettings(grpc_host="0.0.0.0", api_keys_file="keys.json")
    assert GatewaySettings(grpc_host="0.0.0.0", allow_plaintext=True, api_keys_file="k.json")
    tls = {"grpc_tls_cert": "c.pem", "grpc_tls_key": "k.pem", "api_keys_file": "keys.json"}
    assert GatewaySettings(grpc_host="10.1.2.3", **tls)
    assert GatewaySettings(grpc_host="::1") and GatewaySettings(grpc_host="localhost")


@pytest.mark.parametrize(
    "hosts",
    [{"grpc_host": "0.0.0.0"}, {"http_host": "10.1.2.3"}, {"grpc_host": "::", "http_port": -1}],
)
def test_a_gateway_off_loopback_needs_api_keys_or_allow_anonymous(hosts):
    """Before, a gateway published beyond loopback started without keys: anyone reaching the
    port could use it, and every client behind one NAT or proxy shared one quota."""
    tls = {"grpc_tls_cert": "c.pem", "grpc_tls_key": "k.pem"}
    with pytest.raises(ValueError, match=r"no API keys.*tandem api-keys --new.*--api-keys-file"):
        GatewaySettings(**hosts, **tls)
    with pytest.raises(ValueError, match="no API keys"):  # plaintext does not excuse it
        GatewaySettings(**hosts, allow_plaintext=True)
    assert GatewaySettings(**hosts, **tls, api_keys_file="keys.json").api_keys_file
    assert GatewaySettings(**hosts, **tls, allow_anonymous=True).allow_anonymous
    env = {"TANDEM_GRPC_HOST": "0.0.0.0", "TANDEM_ALLOW_PLAINTEXT": "1"}
    with pytest.raises(SystemExit):
        load_settings(GatewaySettings, [], env=env)
    assert load_settings(GatewaySettings, ["--allow-anonymous"], env=env).allow_anonymous
    # loopback needs neither, and an HTTP API that is off does not count
    assert GatewaySettings(grpc_host="127.0.0.1", http_host="0.0.0.0", http_port=-1)


def test_tandem_up_is_secure_unless_told_otherwise(capsys):
    """Before, NATS authentication took --secure."""
    from shared.cli.launcher import _refusal, secured
    from shared.cli.main import parser

    assert secured(parser().parse_args(["up"]))
    insecure = parser().parse_args(["up", "--insecure"])
    assert not secured(insecure) and "warning: --insecure" in capsys.readouterr().err
    assert not secured(parser().parse_args(["up", "--nats-url", "nats://10.0.0.2:4222"]))
    assert "contradict" in _refusal(parser().parse_args(["up", "--secure", "--insecure"]))


def test_the_gil_switch_interval_is_a_common_setting_with_bounds(capsys):
    s = load_settings(GatewaySettings, [], env={"TANDEM_GIL_SWITCH_MS": "1"})
    assert s.gil_switch_ms == 1.0
    assert load_settings(SchedulerSettings, [], env={}).gil_switch_ms == 0.5
    with pytest.raises(SystemExit):
        load_settings(DecodeSettings, ["--gil-switch-ms", "0"], env={})
    assert "gil_switch_ms" in capsys.readouterr().err


def test_the_nats_client_timing_is_a_common_setting_and_reaches_nats_connect(monkeypatch):
    """Read once in main(), handed to the bus, which hands it to nats-py."""
    import asyncio

    import nats

    from shared.control.bus import BusTiming, NatsBus

    env = {"TANDEM_NATS_PING_INTERVAL_S": "3", "TANDEM_NATS_DRAIN_TIMEOUT_S": "9"}
    s = load_settings(GatewaySettings, ["--nats-connect-timeout-s", "4"], env=env)
    timing = BusTiming(
        s.nats_connect_timeout_s,
        s.nats_ping_interval_s,
        s.nats_reconnect_wait_s,
        s.nats_drain_timeout_s,
    )
    assert timing == BusTiming(connect_timeout_s=4.0, ping_interval_s=3.0, drain_timeout_s=9.0)
    seen = {}

    async def connect(**options):
        seen.update(options)
        raise OSError("no server here")

    monkeypatch.setattr(nats, "connect", connect)
    with pytest.raises(OSError):
        asyncio.run(NatsBus(s.nats_url, "n", timing=timing).__aenter__())
    assert (seen["connect_timeout"], seen["ping_interval"]) == (4.0, 3.0)
    assert seen["reconnect_time_wait"] == 0.5


def test_the_nats_timing_defaults_are_the_bus_defaults():
    from shared.control.bus import BusTiming
    from shared.settings import CommonSettings

    s = CommonSettings()
    assert BusTiming() == BusTiming(
        s.nats_connect_timeout_s,
        s.nats_ping_interval_s,
        s.nats_reconnect_wait_s,
        s.nats_drain_timeout_s,
    )


@pytest.mark.parametrize("value", ["0", "-1", "nan", "inf", "soon"])
def test_a_nats_timing_must_be_a_positive_number_of_seconds(value):
    with pytest.raises(SystemExit) as exc:
        load_settings(SchedulerSettings, ["--nats-reconnect-wait-s", value], env={})
    assert exc.value.code == 2


def test_started_moves_what_startup_made_out_of_the_collector_and_drops_its_garbage():
    """A full collection walks only what serving makes after started(); the startup's cycles of
    garbage are collected first, not frozen for the process's life."""

    class Node:
        pass

    kept, cycle = Node(), Node()
    cycle.me = cycle  # garbage once dropped: only the collector can free it
    tracked = weakref.ref(cycle)
    del cycle
    try:
        settings.started()
        assert tracked() is None
        assert gc.get_freeze_count() > 0
        assert not any(o is kept for o in gc.get_objects())
        later = Node()
        assert any(o is later for o in gc.get_objects())
    finally:
        gc.unfreeze()
