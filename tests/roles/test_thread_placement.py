"""``ModelConfig.num_threads``: None takes the worker's CPU share, 0 every core of the machine (the
placement where whichever worker computes uses the cores the others leave idle), a count exactly
that; a negative count is an error before any worker starts."""

from __future__ import annotations

import os

import pytest
import torch

from asyncrl.pipelines.job.config import ConfigError
from asyncrl.pipelines.job.presets import tiny_test
from asyncrl.roles.modeling.models import set_torch_threads


@pytest.fixture
def restore_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize(("num_cpus", "override", "expected"),
                         [(1.0, None, 1), (2.5, None, 2), (0.5, None, 1), (1.0, 0, os.cpu_count()), (1.0, 3, 3)])
def test_torch_threads_follow_the_setting(restore_threads, num_cpus, override, expected):
    assert set_torch_threads(num_cpus, override) == expected
    assert torch.get_num_threads() == expected


def test_a_negative_thread_count_is_refused(restore_threads):
    with pytest.raises(ValueError, match=r"num_threads must be None .*, 0 \(every core\), 'follow' .* or a positive count, got -1"):
        set_torch_threads(1.0, -1)
    cfg = tiny_test()
    cfg.model.num_threads = 0
    cfg.validate()  # every core: allowed
    cfg.model.num_threads = -2
    with pytest.raises(ConfigError, match=r"model\.num_threads must be null \(the worker's CPU share\), 0 \(every core of the machine\), 'follow' .* or a positive integer, got -2"):
        cfg.validate()
