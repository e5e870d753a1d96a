//! Hash maps for the ids the turn loop and the memory store look up at every step (instance
//! keys, submission, attempt and tool-call ids).
//!
//! The standard library's SipHash costs about 200 instructions per short key; an exchange makes
//! some sixty such lookups. foldhash hashes the same keys in a few dozen, and it is seeded
//! per process, so keys a client chooses (instance ids) cannot be aimed at one bucket without
//! knowing the seed.

use std::collections::{HashMap, HashSet};

/// A [`HashMap`] with the seeded fast hasher.
pub(crate) type FastMap<K, V> = HashMap<K, V, foldhash::fast::RandomState>;

/// A [`HashSet`] with the seeded fast hasher.
pub(crate) type FastSet<K> = HashSet<K, foldhash::fast::RandomState>;
