"""TransferMachine, the one base of both KV transfer state machines: a move the table does not
allow raises, every allowed one reaches `_moved`, and a table that leaves a state out is refused
when its class is made."""

import enum

import pytest

from shared.kvtransfer.inbound import InboundTransfer
from shared.kvtransfer.machine import IllegalTransition, TransferMachine
from shared.kvtransfer.outbound import OutboundTransfer


class Light(enum.Enum):
    RED = "red"
    GREEN = "green"
    OFF = "off"


class Lamp(TransferMachine[Light]):
    ALLOWED = {
        Light.RED: frozenset({Light.GREEN, Light.OFF}),
        Light.GREEN: frozenset({Light.RED}),
        Light.OFF: frozenset(),
    }

    def __init__(self) -> None:
        super().__init__("lamp-1", Light.RED)
        self.moves: list[tuple[Light, Light]] = []

    def _moved(self, before: Light, after: Light) -> None:
        self.moves.append((before, after))


def test_allowed_moves_reach_moved_and_others_raise_naming_the_transfer():
    lamp = Lamp()
    lamp._to(Light.GREEN)
    lamp._to(Light.RED)
    assert lamp.moves == [(Light.RED, Light.GREEN), (Light.GREEN, Light.RED)]
    with pytest.raises(IllegalTransition, match="lamp-1: RED -> RED"):
        lamp._to(Light.RED)
    lamp._to(Light.OFF)
    with pytest.raises(IllegalTransition):
        lamp._to(Light.GREEN)
    assert lamp.state is Light.OFF and len(lamp.moves) == 3


def test_a_table_that_leaves_a_state_out_is_refused():
    with pytest.raises(TypeError, match="every state"):

        class Broken(TransferMachine[Light]):
            ALLOWED = {Light.RED: frozenset({Light.GREEN}), Light.GREEN: frozenset()}


def test_both_transfers_share_the_one_base():
    assert issubclass(InboundTransfer, TransferMachine)
    assert issubclass(OutboundTransfer, TransferMachine)
    assert "_to" not in vars(InboundTransfer) and "_to" not in vars(OutboundTransfer)
