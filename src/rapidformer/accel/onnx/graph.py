"""Fixes to an exported ONNX training graph that onnxruntime-training 1.19's gradient builder
needs (used by :mod:`rapidformer.accel.onnx.training` before ``generate_artifacts``).

Each function edits the ``onnx.ModelProto`` in place and returns how many nodes it touched.
"""

from __future__ import annotations

from typing import Any

SAVED_OUTPUTS = {"Dropout": ("mask",), "LayerNormalization": ("mean", "inv_std_dev")}
"""Optional outputs that onnxruntime-training 1.19's gradient of an op reads (``O(1)``,
``O(2)``) and the exporter leaves out; without them the builder fails with ``i <
node_->OutputDefs().size() was false``."""


def add_saved_outputs(model: Any) -> int:
    """Give every Dropout and LayerNormalization node the optional outputs its gradient reads
    (Dropout's mask; LayerNormalization's mean and inverse standard deviation), and every
    Dropout a ``training_mode`` input: the exporter's ``scaled_dot_product_attention`` emits
    its attention dropout without one, which ONNX reads as inference mode (no dropout at
    all). Returns how many nodes there are."""
    from onnx import TensorProto, helper

    training_mode = "rapidformer_dropout_training_mode"
    count = dropouts = 0
    for node in model.graph.node:
        saved = SAVED_OUTPUTS.get(node.op_type)
        if saved is None:
            continue
        count += 1
        for index, suffix in enumerate(saved, start=1):
            if len(node.output) == index:
                node.output.append(f"{node.output[0]}_rapidformer_{suffix}")
        if node.op_type == "Dropout":
            dropouts += 1
            if len(node.input) == 2:
                node.input.append(training_mode)
    if dropouts and training_mode not in {init.name for init in model.graph.initializer}:
        model.graph.initializer.append(
            helper.make_tensor(training_mode, TensorProto.BOOL, [], [True])
        )
    return count


def expand_where_inputs(model: Any) -> int:
    """onnxruntime-training 1.19's Where gradient does not sum a broadcast input's gradient
    back to that input's shape (T5 adds its position bias, shaped for one sample, to the
    scores through a masking Where): the gradient graph then fails to load. Expand such an
    input to the broadcast shape first, so that Expand's gradient does the summing. Returns
    how many inputs were expanded."""
    from onnx import helper, shape_inference

    wheres = [n for n in model.graph.node if n.op_type == "Where"]
    if not wheres:
        return 0
    inferred = shape_inference.infer_shapes(model)
    shapes = {
        v.name: [
            d.dim_value if d.HasField("dim_value") else None for d in v.type.tensor_type.shape.dim
        ]
        for v in [*inferred.graph.value_info, *inferred.graph.input, *inferred.graph.output]
        if v.type.HasField("tensor_type") and v.type.tensor_type.HasField("shape")
    }
    changed = 0
    for node in wheres:
        out = shapes.get(node.output[0])
        for slot in (1, 2):
            name = node.input[slot]
            shape = shapes.get(name)
            if out is None or shape == out:
                continue
            others = [node.input[i] for i in (0, 1, 2) if i != slot]
            current = name
            for k, other in enumerate(others):
                shape_name = f"{name}_rapidformer_where{changed}_shape{k}"
                expanded = f"{name}_rapidformer_where{changed}_expand{k}"
                model.graph.node.insert(
                    list(model.graph.node).index(node),
                    helper.make_node("Shape", [other], [shape_name], name=shape_name),
                )
                model.graph.node.insert(
                    list(model.graph.node).index(node),
                    helper.make_node("Expand", [current, shape_name], [expanded], name=expanded),
                )
                current = expanded
            node.input[slot] = current
            changed += 1
    return changed


def float_argmax(model: Any) -> int:
    """ORT's CPU kernels have no ArgMax/ArgMin for int64 (Hugging Face's GPT-2 classifier
    finds the last real token that way): feed them the values cast to double, exact for
    integers below 2**53, so the indices are the same. Returns how many were changed."""
    from onnx import TensorProto, helper, shape_inference

    nodes = [n for n in model.graph.node if n.op_type in ("ArgMax", "ArgMin")]
    if not nodes:
        return 0
    inferred = shape_inference.infer_shapes(model)
    types = {
        v.name: v.type.tensor_type.elem_type
        for v in [*inferred.graph.value_info, *inferred.graph.input, *inferred.graph.output]
    }
    changed = 0
    for node in nodes:
        if types.get(node.input[0]) not in (TensorProto.INT64, TensorProto.INT32):
            continue
        cast_out = f"{node.input[0]}_rapidformer_double"
        cast = helper.make_node(
            "Cast", [node.input[0]], [cast_out], to=TensorProto.DOUBLE, name=f"{node.name}_cast"
        )
        position = list(model.graph.node).index(node)
        model.graph.node.insert(position, cast)
        node.input[0] = cast_out
        changed += 1
    return changed
