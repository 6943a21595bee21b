"""`await trainer.fit()` inside an asyncio app, beside a small HTTP status endpoint.

The trainer is a coroutine like any other: the app serves ``GET /status`` (step,
reward, buffer occupancy) while training runs in the same event loop. Two things are
measured: a heartbeat task (:class:`~asyncrl.pipelines.supervision.heartbeat.LoopLag`) records how late
the loop runs it -- the loop lag every other task of the app sees, whatever the trainer is
doing (setup, steps, checkpoints, the report) -- and a probe records how long each status
request takes end to end. The loop stays free because the controller never blocks on Ray
(no ``ray.get`` on the loop) and sends its heavy work (report, checkpoint writes, setup)
to threads.

    python examples/fit_in_app.py --steps 30 --port 8321
    curl localhost:8321/status
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from dataclasses import asdict, dataclass, fields

import asyncrl
from asyncrl.pipelines.supervision.heartbeat import LoopLag
from asyncrl.pipelines.job.presets import grpo_toy
from asyncrl.pipelines.trainers.trainer import GRPOTrainer


@dataclass
class Args:
    """Settings of this example."""

    steps: int = 30
    """Training steps."""
    batch_size: int = 64
    """Responses per step."""
    port: int = 0
    """Port of the status endpoint (0 picks a free one)."""
    probe_every: float = 0.05
    """Seconds between the probe's status requests."""
    heartbeat: float = 0.005
    """Seconds between the loop-lag heartbeats."""
    output_dir: str = "runs/fit_in_app"
    """Where the run writes its files."""


def status_of(trainer: GRPOTrainer) -> dict:
    """What ``GET /status`` returns."""
    last = trainer.history[-1] if trainer.history else {}
    return {"step": last.get("step"), "reward": last.get("reward/mean"), "steps": trainer.config.trainer.steps,
            "buffer": asdict(trainer.buffer.statistics())}


async def serve_status(trainer: GRPOTrainer, port: int) -> asyncio.Server:
    """A tiny HTTP/1.0 server: any request gets the trainer's status as JSON."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        body = json.dumps(status_of(trainer)).encode()
        writer.write(b"HTTP/1.0 200 OK\r\nContent-Type: application/json\r\nContent-Length: "
                     + str(len(body)).encode() + b"\r\n\r\n" + body)
        await writer.drain()
        writer.close()

    return await asyncio.start_server(handle, "127.0.0.1", port)


async def probe(port: int, every: float, results: list[tuple[float, dict]], stop: asyncio.Event) -> None:
    """Request /status until `stop`; record (seconds the request took, status)."""
    while not stop.is_set():
        t0 = time.perf_counter()
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /status HTTP/1.0\r\n\r\n")
        raw = await reader.read()
        writer.close()
        results.append((time.perf_counter() - t0, json.loads(raw.split(b"\r\n\r\n", 1)[1])))
        try:
            await asyncio.wait_for(stop.wait(), every)
        except asyncio.TimeoutError:
            pass


async def run(args: Args) -> dict:
    cfg = grpo_toy()
    cfg.trainer.steps, cfg.trainer.batch_size = args.steps, args.batch_size
    cfg.trainer.output_dir, cfg.trainer.progress = args.output_dir, False
    cfg.trainer.plot = True  # the report is drawn at the end of fit(): in a thread, not on the loop
    results: list[tuple[float, dict]] = []
    trainer = GRPOTrainer(cfg)
    async with LoopLag(args.heartbeat) as setup_lag:
        await trainer.setup()
    try:
        server = await serve_status(trainer, args.port)
        port = server.sockets[0].getsockname()[1]
        stop = asyncio.Event()
        async with server, LoopLag(args.heartbeat) as fit_lag:
            prober = asyncio.create_task(probe(port, args.probe_every, results, stop))
            history = await trainer.fit()
            stop.set()
            await prober
    finally:
        await trainer.close()
    during = [s for _, s in results if s["step"] is not None]
    worst = max(t for t, _ in results)
    lag, slag = fit_lag.statistics(), setup_lag.statistics()
    print(f"loop lag during fit(): max {lag['max_s'] * 1000:.1f} ms, p99 {lag['p99_s'] * 1000:.1f} ms, "
          f"p50 {lag['p50_s'] * 1000:.2f} ms over {lag['samples']} heartbeats; during setup (Ray and workers "
          f"starting): max {slag['max_s'] * 1000:.1f} ms")
    print(f"{len(results)} status requests while training, slowest {worst * 1000:.1f} ms; "
          f"reward {history[0]['reward/mean']:.3f} -> {history[-1]['reward/mean']:.3f}")
    return {"history": history, "requests": results, "during_training": during, "slowest_s": worst,
            "loop_lag": lag, "setup_loop_lag": slag}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for f in fields(Args):
        parser.add_argument(f"--{f.name.replace('_', '-')}", type=type(f.default), default=f.default)
    args = Args(**vars(parser.parse_args(argv)))
    # Ray's start holds the GIL for seconds inside its core worker's constructor, whatever thread
    # runs it: start it before the app's loop exists, as an app should (trainer.setup() then finds
    # Ray running). Started from the loop (``await asyncrl.ainit()``), setup lags ~0.5 s.
    asyncrl.init(num_cpus=grpo_toy().trainer.num_cpus)
    return asyncio.run(run(args))


if __name__ == "__main__":
    main()
