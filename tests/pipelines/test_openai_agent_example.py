"""examples/openai_agent.py: its tool, its report of tool use, and (slow) the whole run on a tiny model."""

from __future__ import annotations

import importlib
import json

import pytest

ex = importlib.import_module("examples.openai_agent")


@pytest.mark.parametrize("expression, result", [("17*23", "391"), ("(2+3)*4", "20"), ("7/2", "3.5"), ("-4+1", "-3"),
                                                ("1/0", "error: division by zero"),
                                                ("__import__('os')", "error: only + - * / on numbers")])
def test_the_calculator_computes_arithmetic_and_nothing_else(expression, result):
    assert ex.calculate(expression) == result


def test_tool_use_is_the_fraction_of_sampled_trajectories_that_called_the_tool_per_step(tmp_path):
    rows = [{"step": 0, "response": "<calc>2+2</calc> 4"}, {"step": 0, "response": "4"},
            {"step": 1, "response": "<calc>1</calc>"}, {"step": 0, "response": None}]
    (tmp_path / "samples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert ex.tool_use(str(tmp_path)) == {0: pytest.approx(1 / 3), 1: 1.0}
    assert ex.tool_use(str(tmp_path / "missing")) == {}


@pytest.mark.slow
def test_the_example_trains_its_openai_client_agent_on_a_tiny_model(ray_cluster, tmp_path):
    used = ex.main(ex.Args(steps=2, tiny=True, output_dir=str(tmp_path / "run")))
    assert sorted(used) == [0, 1]  # samples.jsonl has both steps' trajectories
    rows = [json.loads(line) for line in (tmp_path / "run" / "samples.jsonl").read_text().splitlines()]
    assert len(rows) == 16 and all(r["tokens"] for r in rows) and {r["step"] for r in rows} == {0, 1}
