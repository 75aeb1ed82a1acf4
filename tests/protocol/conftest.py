import pytest

from neuroshard.node.wallet import Wallet


@pytest.fixture
def wallets() -> list[Wallet]:
    return [Wallet.from_token(f"p2p-test-wallet-{i}") for i in range(4)]
