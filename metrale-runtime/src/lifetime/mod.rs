//! The one rule that makes metrale sound, in one place: **nothing is freed,
//! unmapped or handed back while queued GPU work may touch it.**
//!
//! This room is the lowest of the house (floor 1, beside `error`): it names no
//! CUDA type of the crate, so every room can retire through it, and the rooms
//! above plug their resources in through two small traits. The shape is
//! wgpu-core's `LifetimeTracker` (`device/life.rs`): a resource is *retired* with
//! what last used it, *triaged* when that has passed, and *freed in one place*.
//!
//! # The contract a resource keeps
//! A resource that queued GPU work may touch (device memory, a mapping, an IPC
//! handle, a host allocation a copy reads, a host function's closure, the code
//! of a captured kernel, a workspace) keeps all of these:
//!
//! 1. **Record every use.** Each safe operation that queues work touching it
//!    notes the stream (the buffers' use records, `memory::Uses`); a use on a
//!    stream of another device is noted as foreign.
//! 2. **Retire, never free in Drop directly, while work may run.** The Drop
//!    orders its release after the recorded uses (stream-ordered free on the own
//!    stream after an event of every foreign stream; `cuMemFree` after waiting
//!    for foreign streams), or hands itself to this room:
//!    - [`Deferred`] (through [`defer`]) while a gate is shut: a capture on a
//!      stream involved (the free would be recorded into the graph), an NCCL
//!      group open ([`nccl_groups_open`]: its collectives reach their streams at
//!      the outermost end), a pending wait on mapped words (`cuMemFree` would
//!      wait for ever). Retried when the capture or group ends and at each
//!      [`drain`]; [`deferred_count`] counts them.
//!    - [`Watched`] (through [`watch`]) when only an event or a stream's
//!      idleness can tell that the work passed (a wait whose host function could
//!      not be queued); [`triage`] finishes it then.
//!    - [`drop_later`] when the last handle is dropped inside a host function
//!      ([`in_host_function`]): the driver may not be called there.
//! 3. **Never call the driver on a host function's thread.** Every call goes
//!    through `cu!`, which refuses there (the flag is [`in_host_function`]); a
//!    Drop on that thread leaks with one line on stderr or goes to
//!    [`drop_later`].
//! 4. **A capture or a failed query is never "idle".** A release that must know
//!    whether work passed asks the driver (event or stream query, never on a
//!    capturing stream) and treats an error as "not passed", except the statuses
//!    [`work_abandoned`] lists (the context will run nothing more).
//! 5. **Keep what a graph or host function needs for as long as it can run.**
//!    A host function's closure is kept until it ran or its graphs are gone
//!    (`stream::host_fn`'s keepers); a graph keeps the modules of every kernel
//!    queued into it and the host functions captured into it (`graph`'s holders).
//! 6. **Report, never silently leak, never panic, never block for ever.** A
//!    release that cannot be ordered leaks with one line on stderr naming what.
//!
//! # Where each rule is tested
//! In `tests/fault/` (the stand-in driver), unless named otherwise:
//! - use records, foreign streams: `soundness.rs`
//!   `stream_ordered_buffer_used_on_another_device_is_freed_after_it`,
//!   `plain_buffer_used_on_another_device_waits_for_it`,
//!   `managed_host_access_waits_for_other_devices`; `memory.rs`
//!   `a_failed_wait_does_not_end_the_borrow_early`;
//! - frees deferred by captures: `soundness.rs`
//!   `frees_wait_for_captures_and_panics_end_them`,
//!   `stress_shared_streams_with_captures`,
//!   `capture_bookkeeping_holds_against_misuse`;
//! - frees deferred by NCCL groups: `tests/nccl.rs`
//!   `group_defers_frees_and_refuses_unlisted_communicators`,
//!   `nested_groups_and_ranges_wait_for_the_outermost_end`;
//! - the host-function flag and drop-later list: `futures.rs`
//!   `metrale_calls_inside_a_host_function_are_refused`,
//!   `a_handle_dropped_inside_a_host_function_is_leaked_not_deadlocked`,
//!   `a_future_dropped_before_completion_frees_nothing_in_use`; `signals.rs`
//!   `mapped_words_held_last_by_a_host_function_are_freed_after_synchronize`;
//! - pending and unseen waits: `signals.rs` `pending_waits_are_counted_until_passed`;
//!   `round4.rs` `a_refused_keeper_leaves_no_wait_counted_for_ever`; `vmm.rs`
//!   `a_pending_wait_makes_sleep_refuse_and_drop_leak`; `review2.rs`
//!   `child_defect_unseen_wait_queried_after_a_reset`,
//!   `child_defect_unseen_wait_triage_invalidates_a_capture`;
//! - host-function keepers and graph holders: `futures.rs`
//!   `a_slot_host_function_taken_by_a_capture_runs_at_most_once`,
//!   `once_host_functions_are_refused_in_a_capture_and_repeatable_ones_replay`;
//!   `round4.rs` `ending_a_capture_keeps_the_host_function_of_another_capture`;
//!   `review2.rs` `held_three_captures_release_their_own`; `graph.rs`
//!   `a_graph_keeps_its_kernels_loaded`; `soundness.rs`
//!   `code_queued_into_a_capture_outlives_its_registry`;
//! - teardown and resets: `teardown.rs`
//!   `teardown_resources_made_after_a_reset_are_freed`.
//!
//! # Adding a resource
//! Give it a use record (or hold the streams it was queued on), order its Drop
//! after them, and when a gate is shut implement [`Deferred`] for its release
//! job (its `still_blocked` names the gate) and [`defer`] it; when only an event
//! can tell, implement [`Watched`]. Add its test beside the ones above.

mod gate;
mod later;

#[cfg(feature = "nccl")]
pub(crate) use gate::nccl_group_on_this_thread;
pub(crate) use gate::{
    in_host_function, nccl_groups_open, wait_out_nccl_groups, work_abandoned, HostFunctionScope,
};
#[cfg(feature = "nccl")]
pub(crate) use later::NcclGroupOpen;
pub(crate) use later::{
    defer, defer_until_drain, deferred_count, drain, drop_later, retry_at_next_drain,
    retry_deferred, triage, watch, Deferred, HeldOutsideHostFns, Watched,
};
