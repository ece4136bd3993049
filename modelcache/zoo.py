"""Reference architectures built as ONNX graphs with seeded random weights.

No model hub is reachable from our machines, so benchmarks and tests build their
models here. Parameter counts follow the published architectures (torchvision's
definitions) with BatchNorm folded into the preceding convolution's bias; the
`tiny-*` models are small graphs that exercise what packing must preserve
(subgraphs, fp16, integer and bool inputs, int8 weights, external data).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from .errors import ModelCacheError

OPSET = 17


class GraphBuilder:
    """Accumulates nodes and initializers; every layer helper returns its output name."""

    def __init__(self, name: str, seed: int = 0):
        self.name = name
        self.rng = np.random.default_rng(seed)
        self.nodes: list[onnx.NodeProto] = []
        self.initializers: list[onnx.TensorProto] = []
        self._counter = 0

    def fresh(self, prefix: str) -> str:
        self._counter += 1
        return f"{prefix}_{self._counter}"

    # -- parameters ---------------------------------------------------------
    def param(self, prefix: str, shape: tuple[int, ...], fan_in: int, dtype=np.float32) -> str:
        # He-style scaling keeps activations finite through deep random nets.
        std = math.sqrt(1.0 / max(fan_in, 1))
        data = (self.rng.standard_normal(shape, dtype=np.float32) * std).astype(dtype)
        return self.const(prefix, data)

    def const(self, prefix: str, data: np.ndarray) -> str:
        name = self.fresh(prefix)
        self.initializers.append(numpy_helper.from_array(np.ascontiguousarray(data), name))
        return name

    def node(self, op: str, inputs: list[str], n_out: int = 1, **attrs) -> str | list[str]:
        outs = [self.fresh(op.lower()) for _ in range(n_out)]
        self.nodes.append(helper.make_node(op, inputs, outs, name=self.fresh(op), **attrs))
        return outs[0] if n_out == 1 else outs

    # -- layers -------------------------------------------------------------
    def conv(self, x: str, cin: int, cout: int, k: int | tuple[int, int], stride: int = 1,
             pad: int | tuple[int, int] = 0, groups: int = 1, relu: bool = True) -> str:
        kh, kw = (k, k) if isinstance(k, int) else k
        ph, pw = (pad, pad) if isinstance(pad, int) else pad
        w = self.param("conv_w", (cout, cin // groups, kh, kw), fan_in=cin // groups * kh * kw * 2)
        b = self.param("conv_b", (cout,), fan_in=1000)
        y = self.node("Conv", [x, w, b], kernel_shape=[kh, kw], strides=[stride, stride],
                      pads=[ph, pw, ph, pw], group=groups)
        return self.node("Relu", [y]) if relu else y

    def maxpool(self, x: str, k: int, stride: int, pad: int = 0, ceil: bool = False) -> str:
        return self.node("MaxPool", [x], kernel_shape=[k, k], strides=[stride, stride],
                         pads=[pad] * 4, ceil_mode=int(ceil))

    def global_avgpool_flat(self, x: str) -> str:
        return self.node("Flatten", [self.node("GlobalAveragePool", [x])], axis=1)

    def linear(self, x: str, fin: int, fout: int, relu: bool = False) -> str:
        w = self.param("fc_w", (fout, fin), fan_in=fin * 2)
        b = self.param("fc_b", (fout,), fan_in=1000)
        y = self.node("Gemm", [x, w, b], transB=1)
        return self.node("Relu", [y]) if relu else y

    def build(self, inputs: list[onnx.ValueInfoProto], outputs: list[onnx.ValueInfoProto],
              opset: int = OPSET) -> onnx.ModelProto:
        graph = helper.make_graph(self.nodes, self.name, inputs, outputs, self.initializers)
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)],
                                  producer_name="modelcache.zoo")
        model.ir_version = 8
        return model


def image_input(batch: str | int = "batch", size: int = 224) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info("input", TensorProto.FLOAT, [batch, 3, size, size])


def logits_output(name: str, classes: int = 1000) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, TensorProto.FLOAT, ["batch", classes])


def _finish(g: GraphBuilder, logits: str, size: int = 224, classes: int = 1000) -> onnx.ModelProto:
    """Name the final tensor `logits` and declare the image input and logits output."""
    g.nodes.append(helper.make_node("Identity", [logits], ["logits"]))
    return g.build([image_input(size=size)], [logits_output("logits", classes)])


# --------------------------------------------------------------------------
# Published architectures
# --------------------------------------------------------------------------

def alexnet(seed: int = 0) -> onnx.ModelProto:
    g = GraphBuilder("alexnet", seed)
    x = g.conv("input", 3, 64, 11, stride=4, pad=2)
    x = g.maxpool(x, 3, 2)
    x = g.conv(x, 64, 192, 5, pad=2)
    x = g.maxpool(x, 3, 2)
    x = g.conv(x, 192, 384, 3, pad=1)
    x = g.conv(x, 384, 256, 3, pad=1)
    x = g.conv(x, 256, 256, 3, pad=1)
    x = g.maxpool(x, 3, 2)  # 6x6 at 224x224, so torchvision's adaptive pool is the identity
    x = g.node("Flatten", [x], axis=1)
    x = g.linear(x, 256 * 6 * 6, 4096, relu=True)
    x = g.linear(x, 4096, 4096, relu=True)
    return _finish(g, g.linear(x, 4096, 1000))


def vgg16(seed: int = 0) -> onnx.ModelProto:
    g = GraphBuilder("vgg16", seed)
    x, cin = "input", 3
    for v in [64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M", 512, 512, 512, "M"]:
        if v == "M":
            x = g.maxpool(x, 2, 2)
        else:
            x = g.conv(x, cin, v, 3, pad=1)
            cin = v
    x = g.node("Flatten", [x], axis=1)
    x = g.linear(x, 512 * 7 * 7, 4096, relu=True)
    x = g.linear(x, 4096, 4096, relu=True)
    return _finish(g, g.linear(x, 4096, 1000))


def _resnet(name: str, blocks: list[int], seed: int) -> onnx.ModelProto:
    g = GraphBuilder(name, seed)
    x = g.conv("input", 3, 64, 7, stride=2, pad=3)
    x = g.maxpool(x, 3, 2, pad=1)
    cin = 64
    for stage, (n, width) in enumerate(zip(blocks, [64, 128, 256, 512])):
        for i in range(n):
            stride = 2 if (i == 0 and stage > 0) else 1
            cout = width * 4
            y = g.conv(x, cin, width, 1)
            y = g.conv(y, width, width, 3, stride=stride, pad=1)  # stride on the 3x3 (ResNet v1.5)
            y = g.conv(y, width, cout, 1, relu=False)
            shortcut = x if (stride == 1 and cin == cout) else g.conv(x, cin, cout, 1, stride=stride, relu=False)
            x = g.node("Relu", [g.node("Add", [y, shortcut])])
            cin = cout
    x = g.global_avgpool_flat(x)
    return _finish(g, g.linear(x, 2048, 1000))


def resnet50(seed: int = 0) -> onnx.ModelProto:
    return _resnet("resnet50", [3, 4, 6, 3], seed)


def resnet101(seed: int = 0) -> onnx.ModelProto:
    return _resnet("resnet101", [3, 4, 23, 3], seed)


def squeezenet1_1(seed: int = 0) -> onnx.ModelProto:
    g = GraphBuilder("squeezenet1_1", seed)

    def fire(x: str, cin: int, squeeze: int, e1: int, e3: int) -> str:
        s = g.conv(x, cin, squeeze, 1)
        return g.node("Concat", [g.conv(s, squeeze, e1, 1), g.conv(s, squeeze, e3, 3, pad=1)], axis=1)

    x = g.conv("input", 3, 64, 3, stride=2)
    x = g.maxpool(x, 3, 2, ceil=True)
    x = fire(x, 64, 16, 64, 64)
    x = fire(x, 128, 16, 64, 64)
    x = g.maxpool(x, 3, 2, ceil=True)
    x = fire(x, 128, 32, 128, 128)
    x = fire(x, 256, 32, 128, 128)
    x = g.maxpool(x, 3, 2, ceil=True)
    x = fire(x, 256, 48, 192, 192)
    x = fire(x, 384, 48, 192, 192)
    x = fire(x, 384, 64, 256, 256)
    x = fire(x, 512, 64, 256, 256)
    x = g.conv(x, 512, 1000, 1)
    return _finish(g, g.global_avgpool_flat(x))


def googlenet(seed: int = 0) -> onnx.ModelProto:
    g = GraphBuilder("googlenet", seed)

    def inception(x: str, cin: int, c1: int, c3r: int, c3: int, c5r: int, c5: int, pool: int) -> str:
        b1 = g.conv(x, cin, c1, 1)
        b2 = g.conv(g.conv(x, cin, c3r, 1), c3r, c3, 3, pad=1)
        b3 = g.conv(g.conv(x, cin, c5r, 1), c5r, c5, 3, pad=1)  # torchvision uses 3x3 here
        b4 = g.conv(g.maxpool(x, 3, 1, pad=1, ceil=True), cin, pool, 1)
        return g.node("Concat", [b1, b2, b3, b4], axis=1)

    x = g.conv("input", 3, 64, 7, stride=2, pad=3)
    x = g.maxpool(x, 3, 2, ceil=True)
    x = g.conv(x, 64, 64, 1)
    x = g.conv(x, 64, 192, 3, pad=1)
    x = g.maxpool(x, 3, 2, ceil=True)
    x = inception(x, 192, 64, 96, 128, 16, 32, 32)
    x = inception(x, 256, 128, 128, 192, 32, 96, 64)
    x = g.maxpool(x, 3, 2, ceil=True)
    x = inception(x, 480, 192, 96, 208, 16, 48, 64)
    x = inception(x, 512, 160, 112, 224, 24, 64, 64)
    x = inception(x, 512, 128, 128, 256, 24, 64, 64)
    x = inception(x, 512, 112, 144, 288, 32, 64, 64)
    x = inception(x, 528, 256, 160, 320, 32, 128, 128)
    x = g.maxpool(x, 2, 2, ceil=True)
    x = inception(x, 832, 256, 160, 320, 32, 128, 128)
    x = inception(x, 832, 384, 192, 384, 48, 128, 128)
    x = g.global_avgpool_flat(x)
    return _finish(g, g.linear(x, 1024, 1000))


def _vit(name: str, seed: int, size: int, patch: int, dim: int, depth: int, heads: int,
         mlp: int, classes: int = 1000) -> onnx.ModelProto:
    g = GraphBuilder(name, seed)
    tokens = (size // patch) ** 2 + 1
    hd = dim // heads
    i64 = lambda vals: g.const("shape", np.array(vals, dtype=np.int64))  # noqa: E731

    def layernorm(x: str) -> str:
        scale = g.const("ln_g", np.ones(dim, np.float32))
        bias = g.const("ln_b", np.zeros(dim, np.float32))
        return g.node("LayerNormalization", [x, scale, bias], axis=-1, epsilon=1e-6)

    def dense(x: str, fin: int, fout: int) -> str:
        w = g.param("dense_w", (fin, fout), fan_in=fin)
        return g.node("Add", [g.node("MatMul", [x, w]), g.param("dense_b", (fout,), fan_in=1000)])

    def gelu(x: str) -> str:
        erf = g.node("Erf", [g.node("Div", [x, g.const("sqrt2", np.array(math.sqrt(2), np.float32))])])
        one = g.const("one", np.array(1.0, np.float32))
        half = g.const("half", np.array(0.5, np.float32))
        return g.node("Mul", [g.node("Mul", [x, g.node("Add", [erf, one])]), half])

    x = g.conv("input", 3, dim, patch, stride=patch, relu=False)      # B, D, H/p, W/p
    x = g.node("Transpose", [g.node("Reshape", [x, i64([0, dim, -1])])], perm=[0, 2, 1])  # B, N, D
    cls = g.param("cls_token", (1, 1, dim), fan_in=1)
    batch_cls = g.node("Expand", [cls, g.node("Concat", [g.node("Slice", [g.node("Shape", [x]), i64([0]), i64([1])]),
                                                           i64([1, dim])], axis=0)])
    x = g.node("Concat", [batch_cls, x], axis=1)
    x = g.node("Add", [x, g.param("pos_embed", (1, tokens, dim), fan_in=1)])
    to_heads = i64([0, -1, heads, hd])
    for _ in range(depth):
        h = layernorm(x)
        qkv = dense(h, dim, 3 * dim)
        q, k, v = g.node("Split", [qkv, i64([dim, dim, dim])], n_out=3, axis=-1)
        q, k, v = (g.node("Transpose", [g.node("Reshape", [t, to_heads])], perm=[0, 2, 1, 3]) for t in (q, k, v))
        scores = g.node("Div", [g.node("MatMul", [q, g.node("Transpose", [k], perm=[0, 1, 3, 2])]),
                                g.const("sqrt_hd", np.array(math.sqrt(hd), np.float32))])
        att = g.node("MatMul", [g.node("Softmax", [scores], axis=-1), v])
        att = g.node("Reshape", [g.node("Transpose", [att], perm=[0, 2, 1, 3]), i64([0, -1, dim])])
        x = g.node("Add", [x, dense(att, dim, dim)])
        x = g.node("Add", [x, dense(gelu(dense(layernorm(x), dim, mlp)), mlp, dim)])
    x = layernorm(x)
    first = g.node("Squeeze", [g.node("Slice", [x, i64([0]), i64([1]), i64([1])]), i64([1])])
    logits = g.node("Add", [g.node("MatMul", [first, g.param("head_w", (dim, classes), fan_in=dim)]),
                            g.param("head_b", (classes,), fan_in=1000)])
    return _finish(g, logits, size=size, classes=classes)


def vit_b_16(seed: int = 0) -> onnx.ModelProto:
    return _vit("vit_b_16", seed, size=224, patch=16, dim=768, depth=12, heads=12, mlp=3072)


# --------------------------------------------------------------------------
# Tiny models for tests: each exercises something packing must preserve
# --------------------------------------------------------------------------

def tiny_cnn(seed: int = 0) -> onnx.ModelProto:
    g = GraphBuilder("tiny_cnn", seed)
    x = g.conv("input", 3, 16, 3, pad=1)
    x = g.maxpool(x, 2, 2)
    x = g.conv(x, 16, 32, 3, pad=1)
    x = g.global_avgpool_flat(x)
    return _finish(g, g.linear(x, 32, 10), size=32, classes=10)


def sized(nbytes: int, seed: int = 0) -> onnx.ModelProto:
    """A lookup table of about `nbytes` of float32 weights, distinct per seed (no tensor shared with another
    seed's): tests and benchmarks that fill tiers and memory limits by the byte. Input ids (int64), output rows."""
    rows = max(1, nbytes // (256 * 4))
    table = np.random.default_rng(seed).standard_normal((rows, 256), dtype=np.float32)
    graph = onnx.helper.make_graph(
        [onnx.helper.make_node("Gather", ["table", "ids"], ["rows"], axis=0)], f"sized_{seed}",
        [onnx.helper.make_tensor_value_info("ids", onnx.TensorProto.INT64, ["n"])],
        [onnx.helper.make_tensor_value_info("rows", onnx.TensorProto.FLOAT, ["n", 256])],
        [onnx.numpy_helper.from_array(table, "table")])
    return onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 17)])


def tiny_vit(seed: int = 0) -> onnx.ModelProto:
    return _vit("tiny_vit", seed, size=32, patch=8, dim=64, depth=2, heads=4, mlp=128, classes=10)


def tiny_if(seed: int = 0) -> onnx.ModelProto:
    """An If whose branches own initializers: packing must reach into subgraphs."""
    rng = np.random.default_rng(seed)

    def branch(tag: str) -> onnx.GraphProto:
        w = numpy_helper.from_array(rng.standard_normal((64, 64)).astype(np.float32), f"w_{tag}")
        node = helper.make_node("MatMul", ["x", f"w_{tag}"], [f"y_{tag}"])
        return helper.make_graph([node], f"branch_{tag}", [],
                                 [helper.make_tensor_value_info(f"y_{tag}", TensorProto.FLOAT, ["batch", 64])], [w])

    nodes = [helper.make_node("If", ["flag"], ["y"], then_branch=branch("then"), else_branch=branch("else"))]
    graph = helper.make_graph(
        nodes, "tiny_if",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 64]),
         helper.make_tensor_value_info("flag", TensorProto.BOOL, [])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 64])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)])
    model.ir_version = 8
    return model


def tiny_fp16(seed: int = 0) -> onnx.ModelProto:
    g = GraphBuilder("tiny_fp16", seed)
    w1 = g.param("w", (64, 128), fan_in=64, dtype=np.float16)
    w2 = g.param("w", (128, 16), fan_in=128, dtype=np.float16)
    h = g.node("Relu", [g.node("MatMul", ["x", w1])])
    g.nodes.append(helper.make_node("MatMul", [h, w2], ["y"]))
    return g.build([helper.make_tensor_value_info("x", TensorProto.FLOAT16, ["batch", 64])],
                   [helper.make_tensor_value_info("y", TensorProto.FLOAT16, ["batch", 16])])


def tiny_embed(seed: int = 0) -> onnx.ModelProto:
    """int64 token ids + bool mask inputs, int8 weights dequantized in the graph."""
    g = GraphBuilder("tiny_embed", seed)
    table = g.param("embedding", (100, 32), fan_in=1)
    q = g.const("w_int8", g.rng.integers(-127, 127, size=(32, 64), dtype=np.int8))
    w = g.node("DequantizeLinear", [q, g.const("scale", np.array(0.02, np.float32)),
                                    g.const("zp", np.array(0, np.int8))])
    emb = g.node("Gather", [table, "ids"], axis=0)                     # B, T, 32
    zero = g.const("zero", np.zeros((1,), np.float32))
    masked = g.node("Where", [g.node("Unsqueeze", ["mask", g.const("axis", np.array([-1], np.int64))]), emb, zero])
    pooled = g.node("ReduceSum", [masked, g.const("axes", np.array([1], np.int64))], keepdims=0)
    g.nodes.append(helper.make_node("MatMul", [pooled, w], ["y"]))
    return g.build([helper.make_tensor_value_info("ids", TensorProto.INT64, ["batch", "seq"]),
                    helper.make_tensor_value_info("mask", TensorProto.BOOL, ["batch", "seq"])],
                   [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 64])])


def tiny_ir3(seed: int = 0) -> onnx.ModelProto:
    """The old model zoo's IR 3 shape (ShuffleNet, converted from Caffe2): every initializer also a graph
    input, channel shuffles through Reshapes whose int64 shapes (OC2_DUMMY_*) repeat from block to block."""
    g = GraphBuilder("tiny_ir3", seed)
    x, channels = "gpu_0/data_0", 3
    for cout in (16, 32, 32):
        x = g.conv(x, channels, cout, 3, pad=1)
        for shape in ([1, 2, cout // 2, 16, 16], [1, cout, 16, 16]):   # shuffle two groups of channels
            if len(shape) == 4:
                x = g.node("Transpose", [x], perm=[0, 2, 1, 3, 4])
            x = g.node("Reshape", [x, g.const("OC2_DUMMY", np.array(shape, np.int64))])
        channels = cout
    x = g.node("Reshape", [g.node("GlobalAveragePool", [x]), g.const("OC2_DUMMY", np.array([1, channels], np.int64))])
    fc_w = g.param("fc_w", (channels, 100), fan_in=channels)
    g.nodes.append(helper.make_node("MatMul", [x, fc_w], ["gpu_0/softmax_1"]))
    model = g.build([helper.make_tensor_value_info("gpu_0/data_0", TensorProto.FLOAT, [1, 3, 16, 16])]
                    + [helper.make_tensor_value_info(t.name, t.data_type, list(t.dims)) for t in g.initializers],
                    [helper.make_tensor_value_info("gpu_0/softmax_1", TensorProto.FLOAT, [1, 100])], opset=7)
    model.ir_version = 3
    return model


def to_fp16(model: onnx.ModelProto) -> onnx.ModelProto:
    """The same graph in fp16 throughout: weights, inputs, outputs, value infos and Casts to float.

    What a converter without keep_io_types writes; done here by hand (no converter is installed).
    """
    out = onnx.ModelProto()
    out.CopyFrom(model)
    for graph in _graphs(out.graph):
        for i, t in enumerate(graph.initializer):
            if t.data_type == TensorProto.FLOAT:
                graph.initializer[i].CopyFrom(numpy_helper.from_array(
                    numpy_helper.to_array(t).astype(np.float16), t.name))
        for vi in [*graph.input, *graph.output, *graph.value_info]:
            if vi.type.tensor_type.elem_type == TensorProto.FLOAT:
                vi.type.tensor_type.elem_type = TensorProto.FLOAT16
        for node in graph.node:
            for a in node.attribute:
                if node.op_type == "Cast" and a.name == "to" and a.i == TensorProto.FLOAT:
                    a.i = TensorProto.FLOAT16
                elif node.op_type == "Constant" and a.name == "value" and a.t.data_type == TensorProto.FLOAT:
                    a.t.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(a.t).astype(np.float16), a.t.name))
    out.graph.name = model.graph.name + "_fp16"
    return out


def _graphs(graph: onnx.GraphProto):
    yield graph
    for node in graph.node:
        for a in node.attribute:
            if a.type == onnx.AttributeProto.GRAPH:
                yield from _graphs(a.g)
            for g in a.graphs:
                yield from _graphs(g)


def resnet50_fp16(seed: int = 0) -> onnx.ModelProto:
    return to_fp16(resnet50(seed))


def vit_b_16_fp16(seed: int = 0) -> onnx.ModelProto:
    return to_fp16(vit_b_16(seed))


# --------------------------------------------------------------------------
# Registry
# --------------------------------------------------------------------------

@dataclass(frozen=True)
class ZooEntry:
    build: Callable[[int], onnx.ModelProto]
    published_params: int | None  # torchvision's figure; None for test models
    summary: str


ZOO: dict[str, ZooEntry] = {
    "alexnet": ZooEntry(alexnet, 61_100_840, "AlexNet, 224x224"),
    "vgg16": ZooEntry(vgg16, 138_357_544, "VGG-16, 224x224"),
    "resnet50": ZooEntry(resnet50, 25_557_032, "ResNet-50 v1.5, 224x224"),
    "resnet101": ZooEntry(resnet101, 44_549_160, "ResNet-101 v1.5, 224x224"),
    "squeezenet1_1": ZooEntry(squeezenet1_1, 1_235_496, "SqueezeNet 1.1, 224x224"),
    "googlenet": ZooEntry(googlenet, 6_624_904, "GoogLeNet (no aux heads), 224x224"),
    "vit_b_16": ZooEntry(vit_b_16, 86_567_656, "ViT-B/16, 224x224"),
    "resnet50-fp16": ZooEntry(resnet50_fp16, 25_557_032, "ResNet-50 v1.5 in fp16 (weights and I/O), 224x224"),
    "vit_b_16-fp16": ZooEntry(vit_b_16_fp16, 86_567_656, "ViT-B/16 in fp16 (weights and I/O), 224x224"),
    "tiny-cnn": ZooEntry(tiny_cnn, None, "two convs and a Gemm, 32x32 input (tests)"),
    "tiny-vit": ZooEntry(tiny_vit, None, "two-layer ViT, 32x32 input (tests)"),
    "tiny-if": ZooEntry(tiny_if, None, "If with initializers in both branches (tests)"),
    "tiny-fp16": ZooEntry(tiny_fp16, None, "fp16 MLP (tests)"),
    "tiny-embed": ZooEntry(tiny_embed, None, "int64 ids, bool mask, int8 weights (tests)"),
    "tiny-ir3": ZooEntry(tiny_ir3, None, "IR 3, initializers as inputs, repeated int64 Reshape shapes (tests)"),
}
ALIASES = {"squeezenet": "squeezenet1_1", "vit": "vit_b_16", "vit-b-16": "vit_b_16"}


def names() -> list[str]:
    return list(ZOO)


class UnknownZooModel(ModelCacheError, KeyError):
    """A name not in the zoo: a KeyError to code that looks names up, one clear line to the CLI."""

    __str__ = Exception.__str__   # (KeyError's would quote the message)


def build(name: str, seed: int = 0) -> onnx.ModelProto:
    key = ALIASES.get(name, name)
    if key not in ZOO:
        import difflib
        close = difflib.get_close_matches(name, [*ZOO, *ALIASES], n=3)
        raise UnknownZooModel(f"no zoo model {name!r}" + (f" (did you mean {' or '.join(close)}?)" if close else "")
                              + "; `modelcache zoo --list` lists them")
    return ZOO[key].build(seed)


def count_params(model: onnx.ModelProto) -> int:
    """Floating-point parameters: what the published counts measure (shape constants excluded)."""
    floats = {TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.BFLOAT16, TensorProto.DOUBLE}
    return sum(int(np.prod(t.dims)) for t in model.graph.initializer if t.data_type in floats and len(t.dims) > 0)


def save(model: onnx.ModelProto, path: str, external_data: bool | None = None) -> None:
    """Write a model; models over protobuf's 2 GB limit go to external data automatically."""
    if external_data is None:
        external_data = model.ByteSize() > 1_900_000_000
    if external_data:
        import os
        onnx.save_model(model, path, save_as_external_data=True, all_tensors_to_one_file=True,
                        location=os.path.basename(path) + ".data", size_threshold=1024)
    else:
        onnx.save_model(model, path)


def sample_inputs(model_or_path, batch: int = 1, seed: int = 0) -> dict[str, np.ndarray]:
    """Random feeds matching a model's declared inputs (symbolic dims: batch, or 8 for others)."""
    from .wire.tensors import random_feeds
    model = onnx.load(model_or_path, load_external_data=False) if isinstance(model_or_path, str) else model_or_path
    init_names = {t.name for t in model.graph.initializer}
    inputs = [{"name": vi.name,
               "dtype": np.dtype(helper.tensor_dtype_to_np_dtype(vi.type.tensor_type.elem_type)).name,
               "shape": [d.dim_value if d.HasField("dim_value") else None for d in vi.type.tensor_type.shape.dim]}
              for vi in model.graph.input if vi.name not in init_names]
    return random_feeds(inputs, batch, seed)
