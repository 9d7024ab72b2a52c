"""PDD's vocabulary is defined once (pdd/vocab.py) and every part uses those values: the
policy, the fleet's and the routing records' Django choices, the agents' wire format."""

from __future__ import annotations

import pytest

from pdd import vocab


def test_the_policy_uses_the_shared_enums():
    from pdd import policy

    assert policy.Pipeline is vocab.Pipeline
    assert policy.HandoffMode is vocab.HandoffMode
    assert policy.Role is vocab.Role
    assert policy.LinkStatus is vocab.LinkStatus
    assert policy.Fallback.RLD_ONLY == vocab.Pipeline.RLD_ONLY


@pytest.mark.django_db
def test_the_django_choices_are_built_from_them():
    from fleet.choices import InstanceRole, LinkStatus
    from routing.choices import HandoffChoice, PipelineChoice

    assert InstanceRole.values == [str(r) for r in vocab.Role]
    assert LinkStatus.values == [str(s) for s in vocab.LinkStatus]
    assert set(vocab.AGENT_PIPELINES) <= set(PipelineChoice.values)
    assert HandoffChoice.values == [str(m) for m in vocab.HandoffMode]


def test_the_agents_wire_format_uses_them():
    from agents.node import settings, wire

    assert wire.PIPELINES == vocab.AGENT_PIPELINES
    assert wire.HANDOFF_MODES == vocab.AGENT_HANDOFF_MODES
    assert tuple(vocab.Role) == settings.ROLES
    assert wire.ROLE_SHORT["relay_decode"] == "rld" and wire.ROLE_SHORT["main_decode"] == "md"


def test_members_are_their_strings():
    import json

    assert vocab.Pipeline.P_MD == "p-md" and f"{vocab.Pipeline.P_RLD_MD}" == "p-rld-md"
    assert json.dumps({"p": vocab.Pipeline.RLD_ONLY}) == '{"p": "rld-only"}'
    assert {vocab.Role.PREFILL: 1}["prefill"] == 1
    assert tuple(vocab.Pipeline) == vocab.Pipeline.CHOICES
