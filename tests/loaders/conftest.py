"""Fixtures of the loader tests."""

import pytest


@pytest.fixture(scope="session")
def arch_ckpt():
    """Factory: arch_ckpt(arch) -> tests.loaders.arch_fixtures.ArchCheckpoint, built once and cached on
    disk (see arch_fixtures.py). A fixture that cannot be built fails the test with the reason."""
    from tests.loaders.arch_fixtures import FixtureError, arch_checkpoint

    def get(arch: str):
        try:
            return arch_checkpoint(arch)
        except FixtureError as e:
            pytest.fail(str(e), pytrace=False)

    return get
