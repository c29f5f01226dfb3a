//! The one rule that makes metrale sound, in one place: **nothing is freed,
//! unmapped or handed back while queued GPU work may touch it.**
//!
//! This room is the lowest of the house (floor 1, beside `error`, which reads its
//! host-function flag in `cu!`): it names no CUDA type of the crate, so every room
//! can retire through it, and the rooms above plug their resources in through two
//! small traits. The shape is wgpu-core's `LifetimeTracker` (`device/life.rs`): a
//! resource is *retired* with what last used it, *triaged* when that has passed,
//! and *freed in one place*. metrale's streams, events and captures are richer
//! than one fence, so "what last used it" is a use record (the streams), and
//! "passed" is an event, a stream's idleness, or the end of a capture or group.
//!
//! `gate.rs` holds the facts a release asks before it runs (one load each on the
//! fast path): the host-function flag, the captures in progress (and this
//! thread's), the waits that may join a capture, the NCCL groups open, and
//! [`work_abandoned`]. `later.rs` holds the lists of what waits and the one place
//! they are worked off ([`drain`]).
//!
//! # The contract a resource keeps
//! A resource that queued GPU work may touch (device memory, a mapping, an IPC
//! handle, pinned memory a copy reads, a host function's closure, the code of a
//! captured kernel, a workspace) keeps all of these:
//!
//! 1. **Record every use.** Each safe operation that queues work touching it
//!    notes the stream (the buffers' use records, `memory::Uses`); a use on a
//!    stream of another device is noted as foreign.
//! 2. **Retire, never free in Drop directly, while work may run.** The Drop
//!    orders its release after the recorded uses (a stream-ordered free on the
//!    own stream after an event of every foreign stream; `cuMemFree` after
//!    waiting for the foreign streams), or hands itself to this room:
//!    - a [`Deferred`] job (through [`defer`], or [`defer_until_drain`]) while a
//!      gate is shut: a capture on a stream involved ([`captures_in_progress`]:
//!      the free would be recorded into the graph), an NCCL group open
//!      ([`nccl_groups_open`]: its collectives reach their streams at the
//!      outermost end), a pending wait on mapped words (`cuMemFree` and
//!      `cuMemFreeHost` would wait for ever), a capture or host function on this
//!      thread. Retried when the capture or group ends and at each [`drain`];
//!      [`deferred_count`] counts them;
//!    - a [`Watched`] item (through [`watch`]) when only an event or a stream's
//!      idleness can tell that the work passed (a wait whose host function
//!      could not be queued); [`triage`] finishes it then;
//!    - [`drop_later`] when the last handle goes inside a host function
//!      ([`in_host_function`]) or a user object's destructor (a driver
//!      thread), where the driver may not be called ([`HeldOutsideHostFns`]
//!      does this for a graph's holds riding with host functions,
//!      `CudaContext::hold_in_graph`'s destructor for those held by user
//!      objects).
//! 3. **Never call the driver on a host function's thread.** Every call goes
//!    through `cu!`, which refuses there; a Drop on that thread leaks with one
//!    line on stderr or goes to [`drop_later`].
//! 4. **A capture or a failed query is never "idle".** A release that must know
//!    whether work passed asks the driver (an event or stream query, never on a
//!    capturing stream) and treats an error as "not passed", except the
//!    statuses [`work_abandoned`] lists (the context will run nothing more).
//! 5. **Keep what a replay needs for as long as it can run.** Kernel code queued
//!    while a capture is open is held ([`hold_while_capturing`]) until captures
//!    end ([`capture_ended`]), and then by the graph; a repeatable host
//!    function's closure queued into a capture is a [`CaptureKeep`] (tagged with
//!    the driver's capture id, pushed and queued under [`capture_keeps`]' lock)
//!    until that capture's end releases its own ([`release_capture_keeps`]),
//!    and then by the graph and its executables; a graph holds what its replays
//!    use (`graph/`: `keep`, `hold`, and the code of its kernels, put into
//!    the graph by `hold_code` before each instantiation or update, so a
//!    replay in flight keeps its modules loaded after the executable and the
//!    registry are gone): through a CUDA user object the graph
//!    retains (`CudaContext::hold_in_graph`: the driver clones it into the
//!    executables and keeps it for launches in flight, so a replay queues
//!    nothing more), or, on a driver without user objects, with its host
//!    functions through [`HeldOutsideHostFns`], kept by a host function queued
//!    after each replay.
//! 6. **Report, never silently leak, never panic, never block for ever.** A
//!    release that cannot be ordered leaks with one line on stderr naming what;
//!    releases still deferred when the process exits are named in one line
//!    then (they are not run: the driver may be gone).
//!
//! # Where each rule is tested
//! In `tests/fault/` (the stand-in driver), unless named otherwise:
//! - 1, use records and foreign streams: `soundness.rs`
//!   `stream_ordered_buffer_used_on_another_device_is_freed_after_it`,
//!   `plain_buffer_used_on_another_device_waits_for_it`,
//!   `managed_host_access_waits_for_other_devices`; `memory.rs`
//!   `a_failed_wait_does_not_end_the_borrow_early`; every operand of a GEMM
//!   (bias, FP8 scales, device scalars): `tests/blas/round5.rs`
//!   `defect_a_bias_and_fp8_scales_get_use_records_as_a_does`;
//! - 2, frees deferred by captures: `soundness.rs`
//!   `frees_wait_for_captures_and_panics_end_them`,
//!   `stress_shared_streams_with_captures`,
//!   `capture_bookkeeping_holds_against_misuse`; by NCCL groups: `tests/nccl.rs`
//!   `group_defers_frees_and_refuses_unlisted_communicators`,
//!   `nested_groups_and_ranges_wait_for_the_outermost_end`; by pending waits:
//!   `signals.rs` `pending_waits_are_counted_until_passed`, `vmm.rs`
//!   `a_pending_wait_makes_sleep_refuse_and_drop_leak`; pinned frees: `review3.rs`
//!   `defect_pinned_free_races_a_wait_queued_after_its_check`,
//!   `held_pinned_dropped_behind_a_pending_wait_freed_once_it_passes`,
//!   `held_pinned_dropped_on_a_capturing_thread_freed_by_an_end_on_another`;
//!   no capture begins between a grouped GEMM's capture check and its wait
//!   (its pointer arrays are freed after it): `tests/blas/round5.rs`
//!   `defect_a_capture_cannot_begin_inside_a_grouped_gemm`;
//! - 2, watched waits: `round4.rs` `a_refused_keeper_leaves_no_wait_counted_for_ever`;
//!   `review2.rs` `child_defect_unseen_wait_queried_after_a_reset`,
//!   `child_defect_unseen_wait_triage_invalidates_a_capture`;
//! - 3, the host-function flag and the drop-later list: `futures.rs`
//!   `metrale_calls_inside_a_host_function_are_refused`,
//!   `a_handle_dropped_inside_a_host_function_is_leaked_not_deadlocked`,
//!   `a_future_dropped_before_completion_frees_nothing_in_use`; `signals.rs`
//!   `mapped_words_held_last_by_a_host_function_are_freed_after_synchronize`;
//! - 4, captures are never idle: `review2.rs`
//!   `child_defect_unseen_wait_triage_invalidates_a_capture`; `graph.rs`
//!   `an_invalidated_capture_is_reported_and_the_stream_recovers`;
//! - 5, keepers and holders: `soundness.rs`
//!   `code_queued_into_a_capture_outlives_its_registry`; `graph.rs`
//!   `a_graph_keeps_its_kernels_loaded`; `futures.rs`
//!   `a_slot_host_function_taken_by_a_capture_runs_at_most_once`,
//!   `once_host_functions_are_refused_in_a_capture_and_repeatable_ones_replay`;
//!   `round4.rs` `ending_a_capture_keeps_the_host_function_of_another_capture`;
//!   `review2.rs` `held_three_captures_release_their_own`; `arena.rs` (a capture
//!   arena's hold); holds through user objects (issue 43): `arena.rs`
//!   `a_replay_that_holds_an_arena_queues_no_host_function`,
//!   `an_executable_keeps_the_arena_after_graph_and_handle_go` (and a replay
//!   in flight after the executable goes),
//!   `reset_works_once_graphs_and_executables_are_dropped`,
//!   `a_captured_host_function_is_held_by_the_driver_not_a_keeper`, the
//!   old-driver fallback `without_user_objects_replays_keep_the_arena_with_a_host_function`
//!   (with a failed keeper leaking, never freeing); an update replacing the
//!   executable's references: `review4.rs`
//!   `held_exec_updated_from_another_arenas_graph_holds_it`; a captured GEMM's
//!   workspace, held before any GEMM of the
//!   capture is recorded (two threads on one capturing stream):
//!   `tests/blas/round5.rs`
//!   `defect_a_second_threads_gemm_waits_for_the_captures_workspace_holder`,
//!   `held_without_user_objects_a_second_threads_gemm_waits_for_the_host_node`;
//!   the code of a replay in flight (queued behind slow work, executable and
//!   registry dropped before it runs; found in review): `replay_code.rs`
//!   `defect_a_replay_in_flight_keeps_its_code_after_executable_and_registry_go`,
//!   the old-driver fallback (a host function after the replay)
//!   `held_without_user_objects_a_replay_in_flight_keeps_its_code`;
//! - 6, teardown and resets: `teardown.rs`
//!   `teardown_resources_made_after_a_reset_are_freed`;
//! - issue 40 (round 5), in `round5.rs` unless named otherwise: 1, a
//!   communicator forgets only streams whose work finished: `tests/nccl/round5.rs`
//!   `defect_deregistration_behind_a_collective_on_a_forgotten_stream`,
//!   `held_finished_streams_are_still_forgotten`; a failed revoke is not a
//!   revoke: `defect_a_failed_revoke_reads_as_revoked`; 6, every context-wide
//!   wait is in flight from its check (`enter_context_wide_wait`):
//!   `defect_unmap_races_a_wait_queued_after_its_check`,
//!   `defect_range_drop_races_a_wait_queued_after_its_check`,
//!   `defect_sleep_races_a_wait_queued_after_its_check`,
//!   `defect_free_races_a_wait_queued_on_a_foreign_stream`; 3, a wait on a
//!   mapped word is refused in a host function before it is counted (it would
//!   wait out a free that waits for it):
//!   `defect_a_host_function_waits_out_a_pinned_free_that_waits_for_it`,
//!   `defect_a_host_function_waits_out_an_unmap_that_waits_for_it`; 2, a pending copy
//!   dropped behind a wait is deferred:
//!   `defect_pending_copy_dropped_behind_a_wait_this_thread_passes`,
//!   `held_pending_copy_dropped_without_a_wait_frees_at_once`; 6, an NCCL
//!   buffer's free waits for the device on a helper, bounded: `tests/nccl/round5.rs`
//!   `defect_nccl_buffer_dropped_behind_a_collective_that_never_completes`,
//!   `held_nccl_buffer_dropped_when_idle_is_freed_before_the_drop_returns`; 6, what is
//!   still deferred at exit is reported once:
//!   `defect_deferred_releases_at_exit_are_reported_once`,
//!   `held_nothing_deferred_says_nothing_at_exit`; 5, registrations after a
//!   shrink and under a graph that captured through them (the replay's
//!   safety contract keeps them): `tests/nccl/round5.rs`
//!   `held_registrations_used_after_shrink`,
//!   `held_registration_dropped_while_a_graph_that_captured_through_it_lives`;
//!   a hostile NVTX tool (unknown ids, a call back during its init, null
//!   entries, writes after it): `tests/nvtx.rs`
//!   `hostile::held_a_hostile_tool_is_contained`; (not a lifetime rule, listed
//!   with the round) linear blob checks and `inspect`: `metrale-cli/tests/linear.rs`
//!   `overlapping_symbol_tables_are_refused_at_once`,
//!   `many_symbol_tables_of_one_string_table_are_checked_once_each`,
//!   `inspect_of_many_kernels_and_sections_is_linear`; 9, the mixed stress
//!   (batched copies, arena captures and replays, GEMMs eager and captured,
//!   NCCL collectives, registrations and groups, empty captures, all on
//!   shared streams; nothing left after the drops): `tests/blas/stress.rs`
//!   `held_mixed_stress_with_captures_on_shared_streams`; 2, a retry hands
//!   its jobs back to the list before it asks whether they are still
//!   blocked (a capture that ends between the two retries a list that holds
//!   them), and every [`drain`] retries what is deferred:
//!   `held_deferred_frees_retried_as_captures_end_on_many_threads` (same
//!   file); 4, a deregistration asks whether its streams are idle inside a
//!   section, never inside another thread's capture: `tests/nccl/round5.rs`
//!   `defect_a_deregistration_query_invalidates_another_threads_capture`.
//!
//! - issue 43's audit (round 6), in `audit6.rs` unless named otherwise: 5,
//!   a capture that retained a GEMM's workspace through a user object makes
//!   its graph hold (its executables' replays are refused inside another
//!   capture, whose graph would hold nothing): `tests/blas/audit6.rs`
//!   `defect_a_graph_holding_a_gemm_workspace_is_replayed_into_a_capture`
//!   (on a driver without user objects the host node's hold already refused
//!   it: `held_without_user_objects_a_workspace_graph_is_not_replayed_into_a_capture`);
//!   5, a GEMM's workspace holder is retained into its capture's graph
//!   inside a section of the stream, so the capture cannot end (and its
//!   graph be destroyed) between reading the graph and retaining into it:
//!   `tests/blas/audit6.rs`
//!   `defect_a_capture_ends_while_a_gemm_holds_its_graph_handle`;
//!   5, a replay queued before an update keeps the old arena, the updated
//!   executable the new one:
//!   `held_a_replay_queued_before_an_update_keeps_the_old_arena`; 3, the
//!   last hold dropped in a user object's destructor (the stand-in's thread,
//!   under its lock) is handed over and freed by the next synchronisation:
//!   `held_the_last_hold_dropped_on_a_driver_thread_is_freed_by_the_next_sync`;
//!   (not a lifetime rule, listed with the round) kernel arguments by address:
//!   `held_every_memory_kind_passes_its_own_address`,
//!   `held_list_pushed_in_a_loop_of_temporary_views_keeps_each_address`,
//!   `tests/nccl/audit6.rs` `held_nccl_memory_passes_the_buffers_address`.
//!
//! The same round's cuBLAS checks that are not lifetime rules sit beside them
//! in `tests/blas/round5.rs`: `plans_reduce_in_the_compute_type_unless_told_otherwise`,
//! `defect_fp8_leading_dimensions_off_16_bytes_are_refused_naming_the_rule`
//! (and on the GPU, `blas::bf16_odd_shapes_are_within_one_ulp_with_exact_reductions`).
//!
//! # Adding a resource
//! Give it a use record (or hold the streams it was queued on) and its context's
//! generation; order its Drop after the uses through `CudaContext::release_with`;
//! when a gate is shut implement [`Deferred`] for its release job (its
//! `still_blocked` says whether the gate is still shut) and [`defer`] it; when
//! only an event can tell, implement [`Watched`]. Add its test beside the ones
//! above.

mod gate;
mod later;

#[cfg(feature = "nccl")]
pub(crate) use gate::nccl_group_on_this_thread;
pub(crate) use gate::{
    capture_depth_counter, captures_in_progress, capturing_on_this_thread, in_host_function,
    nccl_groups_open, unmarked_wait, wait_out_nccl_groups, work_abandoned, HostFunctionScope,
};
#[cfg(feature = "cublas")]
pub(crate) use later::note_held_in_capture;
#[cfg(feature = "nccl")]
pub(crate) use later::NcclGroupOpen;
pub(crate) use later::{
    capture_began, capture_ended, capture_keeps, defer, defer_until_drain, deferred_count, drain,
    drop_later, hold_while_capturing, release_capture_keeps, retry_at_next_drain, retry_deferred,
    take_held_in_capture, triage, watch, CaptureKeep, Deferred, HeldOutsideHostFns, Watched,
};
