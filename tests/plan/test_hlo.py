"""The HLO reader (plan/hlo/): a hand-written module's call graph, trip counts, conditional branches
and collectives; the loop iterations that cost analysis skips, against an unrolled loop's cost."""

import jax
import pytest

from shardtrain.plan import hlo

# A loop of 6 - 2 = 4 iterations whose condition is `counter < 6` and whose counter starts at the
# constant 2 (the TPU compiler's form: no known_trip_count), an all-reduce over the 4 devices of each
# row of a 2 x 4 mesh inside it, and one over the 2 devices of each column in a conditional's branch.
MODULE = """HloModule demo, entry_computation_layout={(f32[1024]{0}, pred[])->f32[1024]{0}}

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %sum = f32[] add(f32[] %a, f32[] %b)
}

%body (p: (s32[], f32[1024])) -> (s32[], f32[1024]) {
  %p = (s32[], f32[1024]) parameter(0)
  %i = s32[] get-tuple-element((s32[], f32[1024]) %p), index=0
  %x = f32[1024] get-tuple-element((s32[], f32[1024]) %p), index=1
  %one = s32[] constant(1)
  %next = s32[] add(s32[] %i, s32[] %one)
  %r = f32[1024] all-reduce(f32[1024] %x), replica_groups={{0,1,2,3},{4,5,6,7}}, to_apply=%add
  ROOT %t = (s32[], f32[1024]) tuple(s32[] %next, f32[1024] %r)
}

%cond (p: (s32[], f32[1024])) -> pred[] {
  %p = (s32[], f32[1024]) parameter(0)
  %i = s32[] get-tuple-element((s32[], f32[1024]) %p), index=0
  %n = s32[] constant(6)
  ROOT %lt = pred[] compare(s32[] %i, s32[] %n), direction=LT
}

%on (x: f32[1024]) -> f32[1024] {
  %x = f32[1024] parameter(0)
  ROOT %g = f32[1024] all-reduce(f32[1024] %x), replica_groups={{0,4},{1,5},{2,6},{3,7}}, to_apply=%add
}

%off (x: f32[1024]) -> f32[1024] {
  ROOT %x = f32[1024] parameter(0)
}

ENTRY %main (x: f32[1024], c: pred[]) -> f32[1024] {
  %x = f32[1024] parameter(0)
  %c = pred[] parameter(1)
  %two = s32[] constant(2)
  %init = (s32[], f32[1024]) tuple(s32[] %two, f32[1024] %x)
  %loop = (s32[], f32[1024]) while((s32[], f32[1024]) %init), condition=%cond, body=%body
  %y = f32[1024] get-tuple-element((s32[], f32[1024]) %loop), index=1
  ROOT %o = f32[1024] conditional(pred[] %c, f32[1024] %y, f32[1024] %y), true_computation=%on, false_computation=%off
}
"""
MESH = {"data": 2, "fsdp": 4}


def test_parse_reads_every_computation_and_walks_callers_first():
    module = hlo.parse_module(MODULE)
    assert list(module.computations) == ["add", "body", "cond", "on", "off", "main"] and module.entry == "main"
    assert [name for name, _ in module.callers_first()] == ["main", "off", "on", "cond", "body", "add"]
    loop = next(i for i in module.computations["main"] if i.opcode == "while")
    assert (loop.name, loop.shape, loop.operands) == ("loop", "(s32[], f32[1024])", ["init"])


def test_loop_runs_read_from_the_condition_or_from_xla_known_trip_count():
    module = hlo.parse_module(MODULE)
    assert hlo.loop_trip_counts(module) == [4]
    runs = hlo.multipliers(module)
    assert (runs["main"], runs["body"], runs["cond"], runs["on"], runs["off"]) == (1, 4, 1, 1, 1)
    assert hlo.multipliers(module, trips=False)["body"] == 1  # as cost analysis counts a loop body
    known = MODULE.replace("body=%body", 'body=%body, backend_config={"known_trip_count":{"n":"5"}}')
    assert hlo.loop_trip_counts(known) == [5] and hlo.multipliers(hlo.parse_module(known))["body"] == 5
    # the MoE dispatch's overflow rounds (models/moe.py OVERFLOW_SCOPE): planned for routing within the buffer
    overflow = MODULE.replace("body=%body", 'body=%body, metadata={op_name="jit(step)/moe_overflow_rounds/while"}')
    assert hlo.loop_trip_counts(overflow) == [0] and hlo.multipliers(hlo.parse_module(overflow))["body"] == 0
    twice = MODULE.replace("body=%body", 'body=%body, backend_config={"known_trip_count":{"n":"2"}}')
    flops, nbytes = hlo.loop_repeats_cost(twice)  # one body's cost past cost analysis's one run
    assert nbytes > 0 and hlo.loop_repeats_cost(overflow) == (-flops, -nbytes)  # that one run taken back


def test_branch_weights_give_each_branch_its_share_of_a_conditionals_runs():
    """An explicit pipeline schedule's `lax.switch` (a conditional of n branches): each branch runs
    its timetable share of the conditional's runs, not every time."""
    switch = MODULE.replace("%c = pred[] parameter(1)", "%c = s32[] parameter(1)").replace(
        "conditional(pred[] %c, f32[1024] %y, f32[1024] %y), true_computation=%on, false_computation=%off",
        "conditional(s32[] %c, f32[1024] %y, f32[1024] %y), branch_computations={%on, %off}")
    module = hlo.parse_module(switch)
    assert (hlo.multipliers(module)["on"], hlo.multipliers(module)["off"]) == (1, 1)
    runs = hlo.multipliers(module, branch_weights={2: (0.25, 0.75)})
    assert (runs["on"], runs["off"], runs["body"]) == (0.25, 0.75, 4)
    assert hlo.multipliers(module, branch_weights={3: (0.25, 0.5, 0.25)})["on"] == 1  # another branch count
    weighted = hlo.collectives(module, MESH, branch_weights={2: (0.25, 0.75)})  # the branch's all-reduce too
    assert [(c.computation, c.count) for c in weighted] == [("body", 4), ("on", 0.25)]


def test_collectives_are_counted_per_run_and_attributed_to_the_axes_their_groups_span():
    rows = hlo.collectives(MODULE, MESH)
    assert [(c.computation, c.kind, c.bytes, c.count, c.group_size, c.axes) for c in rows] == [
        ("body", "all-reduce", 4096, 4, 4, ("fsdp",)), ("on", "all-reduce", 4096, 1, 2, ("data",))]
    assert rows[0].traffic_bytes == 4096 * 2 * 3 / 4 and rows[1].traffic_bytes == 4096  # ring: 2(n-1)/n
    assert hlo.collectives(hlo.parse_module(MODULE), MESH) == rows  # the parsed module reads the same
    assert hlo.summarize(rows)["all-reduce"] == {"count": 5, "bytes": 5 * 4096, "traffic_bytes": 4 * 6144 + 4096,
                                                 "axes": ["fsdp", "data"]}
    assert hlo.traffic_by_axes(rows) == {("fsdp",): 4 * 6144, ("data",): 4096}
    assert hlo.conditional_branches(MODULE) == {"on", "off", "add"}  # and what the branches call


def test_a_ragged_all_to_all_counts_its_output_buffer():
    """Its sizes are run-time values: the output buffer is the most it can move (MaxText's MoE
    dispatch is one)."""
    text = """HloModule r

ENTRY %main (x: bf16[64,128], o: bf16[256,128], s: s32[4]) -> bf16[256,128] {
  %x = bf16[64,128] parameter(0)
  %o = bf16[256,128] parameter(1)
  %s = s32[4] parameter(2)
  ROOT %r = bf16[256,128] ragged-all-to-all(%x, %o, %s, %s, %s, %s), channel_id=1, replica_groups={{0,1,2,3}}
}
"""
    [c] = hlo.collectives(text, {"expert": 4})
    assert (c.kind, c.bytes, c.traffic_bytes, c.axes, c.dtypes) == ("ragged-all-to-all", 256 * 128 * 2,
                                                                    256 * 128 * 2 * 3 / 4, ("expert",), ("bf16",))


def test_a_pallas_kernels_declared_flops_count_on_every_loop_iteration():
    """A Pallas kernel (MaxText's megablox `gmm`, our `ragged_dot` on TPUs) declares its FLOPs in a
    `cost_estimate`, on a line of its own after the kernel's metadata: cost analysis counts them for
    one iteration of the layer loop, `loop_repeats_cost` for the other 3 (4 runs in all)."""
    kernel = ('  %gmm = f32[1024] custom-call(f32[1024] %x), custom_call_target="tpu_custom_call", '
              'frontend_attributes={kernel_metadata={\n"xprof_metadata":"{}"\n}}, backend_config='
              '{"custom_call_config":{"body":"TUzv","cost_estimate":{"flops":"7000","transcendentals":"0"}}}\n')
    reduce = "  %r = f32[1024] all-reduce(f32[1024] %"
    text = MODULE.replace(reduce + "x)", kernel + reduce + "gmm)")
    module = hlo.parse_module(text)
    gmm = next(i for i in module.computations["body"] if i.name == "gmm")
    assert '"flops":"7000"' in gmm.line and [i.name for i in module.computations["body"]][-2:] == ["r", "t"]
    plain = hlo.loop_repeats_cost(MODULE)[0]
    assert hlo.loop_repeats_cost(module)[0] == plain + 3 * 7000
    assert hlo.program_cost(module)[0] == hlo.program_cost(MODULE)[0] + 4 * 7000


def test_loop_iterations_that_cost_analysis_skips_are_added():
    def rolled(w, x):
        return jax.lax.fori_loop(0, 10, lambda i, x: jax.numpy.tanh(x @ w), x)

    def unrolled(w, x):
        for _ in range(10):
            x = jax.numpy.tanh(x @ w)
        return x

    args = (jax.numpy.ones((256, 256)), jax.numpy.ones((64, 256)))
    rolled_c, unrolled_c = (jax.jit(f).lower(*args).compile() for f in (rolled, unrolled))
    cost = {"rolled": rolled_c.cost_analysis(), "unrolled": unrolled_c.cost_analysis()}
    flops, nbytes = hlo.loop_repeats_cost(rolled_c.as_text())
    assert cost["rolled"]["flops"] < cost["unrolled"]["flops"] / 5  # the body counted once
    assert cost["rolled"]["flops"] + flops == pytest.approx(cost["unrolled"]["flops"], rel=1e-3)
    assert cost["rolled"]["bytes accessed"] + nbytes == pytest.approx(cost["unrolled"]["bytes accessed"], rel=0.05)
    assert hlo.loop_repeats_cost(hlo.parse_module(rolled_c.as_text())) == (flops, nbytes)
    assert hlo.loop_repeats_cost(unrolled_c.as_text()) == (0.0, 0.0)
