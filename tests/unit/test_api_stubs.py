"""The committed gRPC stubs are what the proto generates (run `make proto` if not)."""

import pytest

from proto import codegen


@pytest.fixture(scope="module")
def generated() -> dict[str, str]:
    return codegen.generate()


def test_generates_every_stub(generated):
    assert set(generated) == set(codegen.STUBS)
    assert "from shared.api import tandem_pb2" in generated["tandem_pb2_grpc.py"]


@pytest.mark.parametrize("name", codegen.STUBS)
def test_committed_stub_is_current(generated, name):
    committed = (codegen.OUT_DIR / name).read_text()
    assert committed == generated[name], f"shared/api/{name} is stale: run `make proto`"
