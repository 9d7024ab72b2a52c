"""The agent's thread budget and OpenMP wait policy: how flags, env vars, the config file and the
host resolve (a pure function), that `python -m agents serve` puts them in the environment
before torch loads, and that the state document reports them."""

from __future__ import annotations

import json
import subprocess
import sys

import httpx
import pytest

from agents.node.launch import AgentProcess
from agents.node.settings import (
    AgentSettings,
    ThreadPlan,
    apply_thread_plan,
    host_cores,
    load_settings,
    read_config,
    resolve_thread_plan,
)


def plan(flags=None, config=None, environ=None, cores=2) -> ThreadPlan:
    return resolve_thread_plan(flags or {}, config or {}, environ or {}, cores)


# -- resolution ------------------------------------------------------------------------------


def test_the_default_is_the_hosts_cores_divided_among_its_agents():
    assert plan(cores=8).torch_threads == 8
    assert plan({"agents_per_host": 3}, cores=8).torch_threads == 2
    assert plan({"agents_per_host": 3}, cores=2).torch_threads == 1  # never below one
    assert plan({"agents_per_host": 3}, cores=2).threads_source == "default: 2 cores // 3 agents"
    assert plan(cores=1).threads_source == "default: 1 core // 1 agent"


def test_a_flag_beats_its_env_var_which_beats_the_config_file():
    environ = {"BATON_AGENT_THREADS": "3", "BATON_AGENTS_PER_HOST": "2"}
    config = {"threads": 5, "agents_per_host": 4}
    chosen = plan({"threads": 7, "agents_per_host": 1}, config, environ, cores=16)
    assert (chosen.torch_threads, chosen.agents_per_host) == (7, 1)
    assert chosen.threads_source == "--threads = 7"
    chosen = plan({}, config, environ, cores=16)
    assert (chosen.torch_threads, chosen.agents_per_host) == (3, 2)
    assert chosen.threads_source == "BATON_AGENT_THREADS = 3"
    chosen = plan({}, config, {}, cores=16)
    assert (chosen.torch_threads, chosen.agents_per_host) == (5, 4)
    assert chosen.threads_source == "config threads = 5"
    # agents_per_host from the env var drives the default thread count.
    assert plan({}, {}, {"BATON_AGENTS_PER_HOST": "4"}, cores=16).torch_threads == 4


@pytest.mark.parametrize(
    ("flags", "environ", "policy", "source"),
    [
        ({"agents_per_host": 3}, {}, "passive", "auto: 3 agents share 2 cores"),
        ({"threads": 4}, {}, "passive", "auto: 4 threads > 2 cores"),
        ({}, {"CI": "true"}, "passive", "auto: CI is set (a shared runner)"),
        ({}, {}, "active", "auto: 1 agent, 2 of 2 cores, not shared"),
        ({"threads": 1}, {}, "active", "auto: 1 agent, 1 of 2 cores, not shared"),
        (
            {"omp_wait_policy": "auto", "agents_per_host": 2},
            {},
            "passive",
            "auto: 2 agents share 2 cores",
        ),
    ],
)
def test_auto_is_passive_exactly_where_cores_are_shared(flags, environ, policy, source):
    chosen = plan(flags, environ=environ)
    assert (chosen.omp_wait_policy, chosen.source) == (policy, source)


def test_an_omp_wait_policy_already_in_the_environment_wins_over_auto_and_says_so():
    chosen = plan({"agents_per_host": 3}, environ={"OMP_WAIT_POLICY": "ACTIVE"})
    assert chosen.omp_wait_policy == "active"
    assert chosen.source == "environment: OMP_WAIT_POLICY=ACTIVE"
    chosen = plan(environ={"OMP_WAIT_POLICY": "passive"})
    assert (chosen.omp_wait_policy, chosen.source) == (
        "passive",
        "environment: OMP_WAIT_POLICY=passive",
    )


def test_an_explicit_policy_beats_the_environment_and_auto():
    environ = {"OMP_WAIT_POLICY": "PASSIVE", "BATON_OMP_WAIT_POLICY": "passive"}
    chosen = plan({"omp_wait_policy": "active", "agents_per_host": 3}, environ=environ)
    assert (chosen.omp_wait_policy, chosen.source) == ("active", "--omp-wait-policy = active")
    chosen = plan({}, environ={"BATON_OMP_WAIT_POLICY": "Passive", "OMP_WAIT_POLICY": "ACTIVE"})
    assert (chosen.omp_wait_policy, chosen.source) == (
        "passive",
        "BATON_OMP_WAIT_POLICY = passive",
    )
    chosen = plan({}, {"omp_wait_policy": "active"}, {"CI": "1"})
    assert (chosen.omp_wait_policy, chosen.source) == ("active", "config omp_wait_policy = active")


@pytest.mark.parametrize(
    ("flags", "config", "environ", "message"),
    [
        ({"threads": 0}, {}, {}, "--threads must be an integer >= 1, got 0"),
        ({}, {}, {"BATON_AGENT_THREADS": "two"}, "BATON_AGENT_THREADS must be an integer >= 1"),
        ({}, {"threads": True}, {}, "config threads must be an integer >= 1, got True"),
        ({"agents_per_host": -1}, {}, {}, "--agents-per-host must be an integer >= 1, got -1"),
        ({}, {}, {"BATON_AGENTS_PER_HOST": "0"}, "BATON_AGENTS_PER_HOST must be an integer"),
        ({"omp_wait_policy": "spin"}, {}, {}, "--omp-wait-policy must be one of auto|passive"),
        ({}, {}, {"BATON_OMP_WAIT_POLICY": "x"}, "BATON_OMP_WAIT_POLICY must be one of"),
        ({}, {}, {"OMP_WAIT_POLICY": "sometimes"}, "OMP_WAIT_POLICY must be PASSIVE or ACTIVE"),
    ],
)
def test_bad_inputs_are_one_line_errors_naming_where_they_came_from(
    flags, config, environ, message
):
    with pytest.raises(ValueError, match=message) as caught:
        plan(flags, config, environ)
    assert "\n" not in str(caught.value)


def test_the_plan_sets_the_openmp_environment_and_knows_if_torch_was_already_loaded(
    monkeypatch,
):
    environ: dict[str, str] = {"OMP_NUM_THREADS": "8"}
    monkeypatch.delitem(sys.modules, "torch", raising=False)
    applied = apply_thread_plan(plan({"agents_per_host": 3}), environ)
    assert environ == {"OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE"}
    assert applied.set_before_torch is True
    monkeypatch.setitem(sys.modules, "torch", object())  # as if torch had been imported
    assert apply_thread_plan(plan(), {}).set_before_torch is False
    assert applied.as_json()["omp_wait_policy"] == "passive"
    assert "OMP_WAIT_POLICY=PASSIVE (auto: 3 agents share 2 cores)" in applied.line()


def test_settings_take_and_check_the_thread_fields(tmp_path):
    assert AgentSettings().threads is None and AgentSettings().agents_per_host == 1
    with pytest.raises(ValueError, match="agents_per_host must be an integer >= 1"):
        AgentSettings(agents_per_host=0)
    with pytest.raises(ValueError, match="omp_wait_policy must be one of"):
        AgentSettings(omp_wait_policy="spin")
    path = tmp_path / "agent.json"
    path.write_text(json.dumps({"threads": 3, "omp_wait_policy": "passive"}))
    assert read_config(str(path)) == {"threads": 3, "omp_wait_policy": "passive"}
    assert load_settings(str(path), {}).threads == 3
    path.write_text(json.dumps({"thread_plan": {}}))
    with pytest.raises(ValueError, match="unknown keys"):
        read_config(str(path))


# -- the process -----------------------------------------------------------------------------


def test_the_command_line_modules_do_not_load_torch():
    """agents/__main__.py and the settings it resolves the plan with must not import torch:
    OpenMP reads OMP_WAIT_POLICY once, when torch loads it."""
    code = (
        "import sys, agents.__main__, agents.node.settings, agents.node.launch; "
        "print(sorted(m for m in ('torch', 'numpy') if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert out.stdout.strip() == "[]"


def test_an_agent_sharing_the_host_waits_passively_and_reports_it(monkeypatch):
    """`python -m agents serve --agents-per-host 3`, from an environment that chooses nothing:
    the process's OMP_WAIT_POLICY is PASSIVE, set before torch loaded, and /state says why."""
    for name in (
        "OMP_WAIT_POLICY",
        "OMP_NUM_THREADS",
        "CI",
        "BATON_OMP_WAIT_POLICY",
        "BATON_AGENT_THREADS",
        "BATON_AGENTS_PER_HOST",
    ):
        monkeypatch.delenv(name, raising=False)
    agent = AgentProcess(["--listen", "127.0.0.1:0", "--agents-per-host", "3"], "threads")
    try:
        agent.start()
        threads = httpx.get(f"{agent.http}/state", timeout=30).json()["threads"]
        log = agent.log_text()
    finally:
        agent.kill()
        agent.cleanup()
    cores = host_cores()
    assert threads["omp_wait_policy"] == "passive"
    assert threads["source"] == f"auto: 3 agents share {cores} core{'s' if cores > 1 else ''}"
    assert threads["torch_threads"] == max(1, cores // 3)
    assert threads["agents_per_host"] == 3 and threads["cores"] == cores
    assert threads["set_before_torch"] is True
    assert threads["environment"] == {
        "OMP_WAIT_POLICY": "PASSIVE",
        "OMP_NUM_THREADS": str(max(1, cores // 3)),
    }
    assert "OMP_WAIT_POLICY=PASSIVE (auto: 3 agents share" in log


def test_a_bad_thread_flag_exits_2_with_one_line():
    out = subprocess.run(
        [sys.executable, "-m", "agents", "serve", "--agents-per-host", "0"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2
    assert (
        out.stderr.strip()
        .splitlines()[-1]
        .endswith("error: --agents-per-host must be an integer >= 1, got 0")
    )


def test_the_state_document_carries_threads():
    from agents.node.agent import Agent

    agent = Agent(AgentSettings())
    threads = agent.reporting.state()["threads"]
    assert set(threads) >= {"torch_threads", "omp_wait_policy", "source"}
    assert threads["torch_threads"] >= 1
    settings = AgentSettings(thread_plan=plan({"agents_per_host": 3}))
    threads = Agent(settings).reporting.state()["threads"]
    assert threads["torch_threads"] == 1 and threads["omp_wait_policy"] == "passive"
    assert threads["source"] == "auto: 3 agents share 2 cores"


def test_the_advertised_wan_port_is_what_peers_are_told():
    """Behind NAT, a port forward or a proxy, peers reach the WAN fabric at another port."""
    from types import SimpleNamespace

    from agents.node.agent import Agent
    from agents.node.settings import AgentSettings

    agent = Agent(AgentSettings(advertise_wan_port=7001))
    agent.links.intra_server = SimpleNamespace(host="127.0.0.1", port=6000)
    agent.links.wan_server = SimpleNamespace(host="127.0.0.1", port=6001)
    assert agent.links.kv_endpoint() == {"host": "127.0.0.1", "port": 6000, "wan_port": 7001}
    agent.settings.advertise_wan_port = None
    assert agent.links.kv_endpoint()["wan_port"] == 6001
    for bad in (0, 70000, True, "7001"):
        with pytest.raises(ValueError, match="advertise_wan_port"):
            AgentSettings(advertise_wan_port=bad)
