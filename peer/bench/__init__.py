"""Benchmarks: quality, throughput on the namespace test bed, projection, plot, profile."""


def emit_json(result: dict, path=None) -> dict:
    """A benchmark's result as indented JSON: to `path`, or to stdout when there is none."""
    import json

    text = json.dumps(result, indent=2)
    if path is None:
        print(text)
    else:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return result
