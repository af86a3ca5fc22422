"""Process-wide event counters that tests and users can read: ``kimi_cg.counters["captures"]``.

Keys (missing keys read as 0):
  dynamo_graphs               graphs the backend received from dynamo
  graph_breaks                graph breaks reported in frames kimi_cg compiled
  frames_skipped              kimi_cg frames dynamo gave up on (they run eagerly; warned with the fix)
  asserts_with_computed_messages  asserts on grid values with an expression as message, traced as
                              checks instead of graph breaks (NOTE [asserts with a computed message])
  device_programs_compiled    device programs built (structurally equal ones are built once)
  device_programs_run         device programs that ran at least once (compiled, for Inductor ones: NOTE
                              [programs that ran] in kimi_cg/device_program.py)
  device_program_cache_hits   dynamo graphs that reused an existing device program
  device_program_respecializations  symbolic runs of a device program (its row counts, its Inductor
                              compile) again at a call's sizes, which an earlier run's guards did not
                              cover (NOTE [hints of a symbolic run])
  program_cache_hits/stores   Inductor compiles of device programs loaded from / written to the program
                              cache (KIMI_CG_PROGRAM_CACHE; NOTE [program cache] in program_cache.py)
  program_cache_errors        entries that did not load or could not be written (the program compiles)
  host_programs_built         host metadata programs built (one per dynamo graph)
  grid_samplers_traced_direct F.grid_sample calls traced as the kernel its composite picks (NOTE [grid
                              sampler] in grid_sampler.py)
  repeats_by_grid_value       ``repeat_interleave`` by an unbacked count traced with a runtime check (NOTE
                              [repeat by a grid value] in repeat_by_grid_value.py)
  resizes_traced_by_shape     F.interpolate calls whose fake run in dynamo's trace gave only the output's
                              metadata (NOTE [resize traced by shape] in resize_shapes.py)
  patch_convolutions_as_matmuls  convolutions over pre-cut patches traced as one matmul (NOTE [patch
                              convolution as a matmul] in canonicalize/patch_conv.py), per dynamo graph
  linear_gelu_epilogues       linear layers whose tanh GELU became one op (NOTE [linear + GELU epilogue] in
                              canonicalize/linear_gelu.py), per dynamo graph
  table_gathers               per-item reads of a module-state table made one device gather (NOTE [table
                              gathers] in runtime/table_rows.py), per dynamo graph
  table_gather_pairs          of their bicubic resizes, those of the table's own grid planned as 4 row by 4
                              column taps, per dynamo graph
  table_sums_split            per-item sums of two tables' reads split into one read per table, at least one
                              side gathered (NOTE [sums of table reads] in canonicalize/table_gather.py), per graph
  embedding_reads_gathered    reads of a module-state table by a grid-made index (table[index], embedding,
                              embedding_bag) made device gathers (NOTE [embedding reads] in
                              canonicalize/embedding_reads.py), per dynamo graph
  metadata_cache_hits/misses  per-item host metadata lookups
  batch_cache_hits            calls whose whole host pass was reused (same grid, same weights)
  moved_batch_hits            of those, calls that reused the device copies of that batch's host outputs
                              (NOTE [moved batches] in runtime/runner.py)
  fills_skipped               static bucket inputs a replay found holding its value already (NOTE [moved
                              batches])
  state_content_checks        state tensors compared with their snapshot (NOTE [state tokens])
  state_snapshots_taken       state tensors seen new or changed (a new token, a new snapshot)
  graph_replays, captures     CUDA-graph replays and captures (CUDA runtime)
  host_block_copies           calls whose host-made bucket inputs went to the bucket in one copy (option
                              host_block; NOTE [host block] in runtime/graphs.py)
  exact_size_replays          of graph_replays, those of exact-size graphs (NOTE [exact-size graphs])
  exact_size_captures         exact-size graphs captured (not in ``captures``: they are made at a size's
                              third call, after any warm-up, by design)
  exact_size_graphs_dropped   exact-size graphs dropped, least recently used first, to keep the limit
  exact_size_graph_failures   graph sets whose exact-size graph could not be made (they are off since)
  length_class_captures       bucket graphs captured at a segment-length bound below the bucket's capacity
                              (NOTE [segment-length classes] in runtime/graphs.py)
  length_class_replays        of graph_replays, those of such graphs; length_class_runs: the same on the
                              padded path without capture (CPU)
  length_class_failures       graph sets whose bounded graphs could not be made (classes are off since)
  padded_runs                 calls run padded in a bucket without a captured graph (no CUDA, or the
                              capture failed): the padded path without the replay
  eager_fallbacks             calls or items that ran the non-graphed device program
  padding_hazards             device programs that must not run on padded rows (NOTE [row locality]):
                              their calls run the non-graphed program
  split_calls                 calls too large for one replay, run as several replays of whole items
  buckets_dropped_for_memory  buckets whose buffers or capture ran out of memory (NOTE [memory pressure])
  capture_failures            graph sets whose device program could not be captured (run padded, uncaptured)
  lift_fallbacks              dynamo graphs kimi_cg could not lift: they run unchanged (reasons in
                              ``kimi_cg.fallbacks``)
  call_fallbacks              calls of a lifted graph that ran the captured graph instead (a call-time
                              compiler limit; reasons in ``kimi_cg.fallbacks``)
  dynamic_shape_op_breaks     frames whose ops with data-dependent output sizes failed the full settings:
                              traced with those ops as graph breaks since (NOTE [settings ladder])
  dynamo_setting_fallbacks    frames dynamo failed to trace with kimi_cg's settings (traced with its own since)
  dynamo_trace_failures       calls whose frame dynamo failed to trace for another reason (run eagerly)
  flash_path_traces           traces of transformers' towers on their packed flash branch (NOTE [flash path])
  flash_path_refusals         frames whose flash branch made a call kimi_cg cannot compute exactly: that call
                              ran eagerly, later calls trace the sdpa branch
  invalid_inputs              calls rejected with InvalidInputError (the captured graph rejected them too)

``timings`` (seconds, host wall clock, accumulated) says where compile-time cost goes:
  backend                     in the backend per dynamo graph (passes, lift, host program), without
                              the device compile below
  device_compile              compiling device programs (Inductor), at their first call
  capture                     allocating and capturing bucket graphs (their two warm-up runs included,
                              and with them Triton's loading of the compiled kernels)
The rest of a first call (dynamo's trace of the model, AOT tracing) is its total minus these.
"""

from __future__ import annotations

import collections

counters: collections.Counter[str] = collections.Counter()
timings: collections.Counter[str] = collections.Counter()


def reset() -> None:
    """Zero every counter and forget every cached program and metadata entry."""
    counters.clear()
    timings.clear()
    from kimi_cg import device_program, dynamo_settings, fallback
    from kimi_cg.debug import clear_reports
    from kimi_cg.ops import resize

    fallback.clear()
    clear_reports()
    dynamo_settings.clear()
    dynamo_settings.install()  # torch._dynamo.reset() drops dynamo's compile callbacks
    device_program.clear_program_cache()
    resize.clear_matrix_cache()
