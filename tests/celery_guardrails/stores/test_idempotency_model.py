"""The claim protocol of both real stores against a small reference model of its rules (Hypothesis, stateful).

Deliveries claim, renew, complete, fail, release and take over one key, interleaved in any order, on a clock
the test moves; after every step the store's answer and the key's state must be the model's. Hypothesis
shrinks a failure to the shortest sequence of steps that shows it.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule, run_state_machine_as_test

pytestmark = pytest.mark.django_db(transaction=True)
T0 = 1_800_000_000.0
NAMES = ["host@a:1:task-1:p.1", "host@b:2:task-2:p.1", "host@c:3:task-3:p.1"]
OWNERS = st.sampled_from(NAMES)
LEASES = st.sampled_from([1.0, 5.0, 30.0])
#: Redis expires a key after its retention in real time: far longer than a test, so only the model's clock
#: (the ``now`` each call is given) decides.
RETENTION = 3600


@dataclass
class Key:
    """The model of one key: None (absent), or its state, owner, lease end and text."""

    state: str
    owner: str
    lease_until: float = 0.0
    text: str = ""


def model_test(store: Any) -> None:
    class ClaimProtocol(RuleBasedStateMachine):
        @initialize()
        def start(self) -> None:
            self.key = f"tests.model:-:{uuid.uuid4().hex}"
            self.now = T0
            self.model: Key | None = None

        @rule(seconds=st.sampled_from([0.0, 0.5, 1.0, 4.0, 31.0]))
        def time_passes(self, seconds: float) -> None:
            self.now += seconds

        @rule(owner=OWNERS, lease=LEASES, replaces=st.sampled_from(["", *NAMES]))
        def claim(self, owner: str, lease: float, replaces: str) -> None:
            got = store.claim(self.key, owner=owner, now=self.now, lease=lease, retention=RETENTION, replaces=replaces)
            k = self.model
            if k is None:
                expected = ("acquired", False, "", "")
                self.model = Key("claimed", owner, self.now + lease)
            elif k.state in ("completed", "failed"):
                expected = (k.state, False, k.text, k.owner)
            elif k.owner == owner:
                expected = ("acquired", False, "", "")
                k.lease_until = self.now + lease
            elif k.lease_until > self.now and k.owner != replaces:
                expected = ("busy", False, "", k.owner)
                assert got.lease_until == pytest.approx(k.lease_until)
            else:
                expected = ("acquired", True, "", "")
                self.model = Key("claimed", owner, self.now + lease)
            text = got.summary if got.state == "completed" else got.reason
            assert (got.state, got.takeover, text, got.owner) == expected

        @rule(owner=OWNERS, lease=LEASES)
        def heartbeat(self, owner: str, lease: float) -> None:
            got = store.extend(self.key, owner=owner, now=self.now, lease=lease)
            k = self.model
            holds = k is not None and k.state == "claimed" and k.owner == owner
            assert got is holds
            if holds:
                assert k is not None
                k.lease_until = self.now + lease

        @rule(owner=OWNERS, finish=st.sampled_from(["completed", "failed"]), text=st.sampled_from(["x", "y"]))
        def finish(self, owner: str, finish: str, text: str) -> None:
            operation = store.complete if finish == "completed" else store.fail
            field = {"summary": text} if finish == "completed" else {"reason": text}
            got = operation(self.key, owner=owner, now=self.now, retention=RETENTION, **field)
            k = self.model
            if k is not None and k.state == "claimed" and k.owner == owner:
                assert got is True
                self.model = Key(finish, owner, text=text)
            else:  # refused, unless this owner made this very finish before (its answer was lost)
                assert got is (k is not None and k.state == finish and k.owner == owner)

        @rule(owner=OWNERS)
        def release(self, owner: str) -> None:
            got = store.release(self.key, owner=owner)
            k = self.model
            holds = k is not None and k.state == "claimed" and k.owner == owner
            assert got is holds
            if holds:
                self.model = None

        @rule()
        def reopen(self) -> None:
            got = store.reopen(self.key)
            failed = self.model is not None and self.model.state == "failed"
            assert got is failed
            if failed:
                self.model = None

        @invariant()
        def the_key_is_what_the_model_says(self) -> None:
            if not hasattr(self, "key"):
                return
            stored = store.inspect(self.key)
            if self.model is None:
                assert stored is None
                return
            assert stored is not None
            assert (stored["state"], stored["owner"]) == (self.model.state, self.model.owner)

    run_state_machine_as_test(ClaimProtocol, settings=settings(max_examples=40, stateful_step_count=30, deadline=None))


def test_the_claim_protocol_follows_the_model(store: Any) -> None:
    model_test(store)
