import logging

import pytest
import torch


@pytest.fixture(autouse=True)
def _quiet_and_seeded():
    logging.getLogger("remat_plugin").setLevel(logging.WARNING)
    torch.manual_seed(0)
    yield
