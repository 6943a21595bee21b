"""What a run shows: metrics sinks, the report, samples, the trace, the viewer."""
