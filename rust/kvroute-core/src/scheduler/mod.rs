//! Scheduler: worker registry, in-flight ledger, policies, atomic select-and-reserve.
