"""What the CPU kernel tests share."""
import pytest

from radixflow.kernels import cpu_ext


@pytest.fixture(scope="module")
def built():
    if cpu_ext.wait(600) is None:
        pytest.fail("the CPU kernels did not build (g++ and ninja are needed)")
