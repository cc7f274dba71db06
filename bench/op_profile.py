"""Per-op latency of a .tflite on this machine: every op cut out into a one-op model, fed the tensors that one
run of the whole graph produced, and timed alone.

    python bench/op_profile.py model.tflite [--threads 2] [--runs 5] [--top 30] [--json out.json]

Prints the slowest ops (time, index, op, output shapes, onnx2tf's op name) and the total per op type. LiteRT's
Python API has no op profiler and this project does not build TFLite's benchmark_model; cutting ops out answers
the question that matters when a graph is slow: which ops take the time. An op alone is not exactly the op in
its graph: XNNPACK runs each float op as its own partition, and a RESHAPE that the whole graph may run in
place copies its tensor here. The sum of the ops is printed beside the whole graph's latency to show the gap.
Inputs are random normal floats (integer inputs: zeros), the same for the whole run and the cut-out ops.
"""
from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def _schema():
    from ai_edge_litert import schema_py_generated as schema
    return schema


def _random_inputs(interpreter) -> dict:
    rng = np.random.default_rng(0)
    return {d["index"]: (rng.standard_normal(d["shape"]).astype(d["dtype"]) if np.issubdtype(d["dtype"], np.floating)
                         else np.zeros(d["shape"], d["dtype"])) for d in interpreter.get_input_details()}


def _timed(interpreter, runs: int) -> float:
    times = []
    for _ in range(runs + 1):  # the first run warms up
        start = time.perf_counter()
        interpreter.invoke()
        times.append((time.perf_counter() - start) * 1000)
    return statistics.median(times[1:])


def one_op_models(path: Path):
    """(op index, op name, the op as a model of its own: flatbuffer bytes, its input tensor indices) per op.
    Tensor indices are those of the whole graph: the cut-out model keeps every tensor and buffer."""
    import flatbuffers

    schema = _schema()
    model = schema.ModelT.InitFromObj(schema.Model.GetRootAsModel(path.read_bytes(), 0))
    graph = model.subgraphs[0]
    names = {code: name for name, code in vars(schema.BuiltinOperator).items() if not name.startswith("_")}

    def constant(tensor: int) -> bool:
        data = model.buffers[graph.tensors[tensor].buffer].data
        return data is not None and len(data) > 0

    for index, op in enumerate(graph.operators):
        cut, sub = copy.copy(model), copy.copy(graph)
        sub.operators = [op]
        sub.inputs = [t for t in op.inputs if t >= 0 and not constant(t)]
        sub.outputs = list(op.outputs)
        cut.subgraphs, cut.signatureDefs = [sub], []
        builder = flatbuffers.Builder(1024)
        builder.Finish(cut.Pack(builder), file_identifier=b"TFL3")
        code = model.operatorCodes[op.opcodeIndex]
        yield index, names.get(max(code.builtinCode, code.deprecatedBuiltinCode), "CUSTOM"), bytes(builder.Output()), \
            sub.inputs, [(t, tuple(graph.tensors[t].shape), graph.tensors[t].name.decode()) for t in op.outputs]


def profile(path: Path, threads: int, runs: int, check: bool = False) -> dict:
    """Time the whole graph, then each op alone; with `check`, also the largest difference between each op's
    output alone and in the whole run (the cut is faithful when it is 0)."""
    from ai_edge_litert.interpreter import Interpreter, OpResolverType

    whole = Interpreter(model_path=str(path), num_threads=threads)
    whole.allocate_tensors()
    feed = _random_inputs(whole)
    for index, value in feed.items():
        whole.set_tensor(index, value)
    whole_ms = _timed(whole, runs)
    # Every intermediate of one run, to feed the cut-out ops (no delegate: XNNPACK would hide them).
    tensors = Interpreter(model_path=str(path), experimental_preserve_all_tensors=True,
                          experimental_op_resolver_type=OpResolverType.BUILTIN_WITHOUT_DEFAULT_DELEGATES)
    tensors.allocate_tensors()
    for index, value in feed.items():
        tensors.set_tensor(index, value)
    tensors.invoke()
    ops = []
    with tempfile.TemporaryDirectory() as work:
        for index, name, flatbuffer, inputs, outputs in one_op_models(path):
            file = Path(work) / "op.tflite"
            file.write_bytes(flatbuffer)
            alone = Interpreter(model_path=str(file), num_threads=threads)
            alone.allocate_tensors()
            for tensor in inputs:
                alone.set_tensor(tensor, tensors.get_tensor(tensor))
            row = {"index": index, "op": name, "ms": round(_timed(alone, runs), 3),
                   "outputs": [{"shape": [int(d) for d in shape], "name": tensor_name} for _, shape, tensor_name in outputs]}
            if check:
                row["max_abs_vs_graph"] = max(float(np.abs(alone.get_tensor(t).astype(np.float64)
                                                           - tensors.get_tensor(t).astype(np.float64)).max(initial=0))
                                              for t, _, _ in outputs)
            ops.append(row)
    by_type: dict[str, float] = {}
    for row in ops:
        by_type[row["op"]] = by_type.get(row["op"], 0.0) + row["ms"]
    return {"graph": str(path), "threads": threads, "runs": runs, "whole_ms": round(whole_ms, 3),
            "sum_of_ops_ms": round(sum(r["ms"] for r in ops), 3),
            "by_type_ms": {k: round(v, 3) for k, v in sorted(by_type.items(), key=lambda kv: -kv[1])}, "ops": ops}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("graph", type=Path)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--top", type=int, default=30)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    record = profile(args.graph, args.threads, args.runs)
    print(f"{args.graph}: whole graph {record['whole_ms']:.1f} ms, sum of its {len(record['ops'])} ops alone "
          f"{record['sum_of_ops_ms']:.1f} ms ({args.threads} threads, median of {args.runs})")
    for row in sorted(record["ops"], key=lambda r: -r["ms"])[:args.top]:
        shapes = ", ".join(str(tuple(o["shape"])) for o in row["outputs"])
        print(f"{row['ms']:8.2f} ms  #{row['index']:<4} {row['op']:<16} {shapes:<22} {row['outputs'][0]['name'][:60]}")
    print("per op type: " + ", ".join(f"{k} {v:.1f} ms" for k, v in record["by_type_ms"].items()))
    if args.json:
        args.json.write_text(json.dumps(record, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
