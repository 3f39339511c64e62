//! The CPU offload tier: an LRU set of block hashes with a fixed capacity in blocks.
//!
//! Blocks evicted from the GPU are copied here; a prefix hit can continue here past the GPU
//! prefix, at the cost of a load. Events follow vLLM's OffloadingConnector defaults: a CPU
//! `BlockStored` is a hash-only placeholder (`token_ids=[]`, `block_size=0`, no parent), a CPU
//! `BlockRemoved` names the evicted hash, one hash per event.
use hashbrown::HashMap;

use super::idhash::IdHashBuilder;
use crate::events::{BlockRemoved, BlockStored, KvEvent, Medium};

const NIL: u32 = u32::MAX;

#[derive(Debug, Clone, Copy)]
struct Entry {
    hash: u64,
    prev: u32,
    next: u32,
}

/// An LRU of block hashes: `head` is the least recently used.
#[derive(Debug, Clone)]
pub struct CpuTier {
    capacity: usize,
    slots: Vec<Entry>,
    free: Vec<u32>,
    map: HashMap<u64, u32, IdHashBuilder>,
    head: u32,
    tail: u32,
}

impl CpuTier {
    pub fn new(capacity: usize) -> Self {
        CpuTier {
            capacity,
            slots: Vec::new(),
            free: Vec::new(),
            map: HashMap::with_hasher(IdHashBuilder),
            head: NIL,
            tail: NIL,
        }
    }

    pub fn capacity(&self) -> usize {
        self.capacity
    }

    pub fn len(&self) -> usize {
        self.map.len()
    }

    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }

    pub fn contains(&self, hash: u64) -> bool {
        self.map.contains_key(&hash)
    }

    /// Hashes in LRU order, least recently used first (tests).
    pub fn lru_order(&self) -> Vec<u64> {
        let mut out = Vec::with_capacity(self.len());
        let mut i = self.head;
        while i != NIL {
            out.push(self.slots[i as usize].hash);
            i = self.slots[i as usize].next;
        }
        out
    }

    fn unlink(&mut self, i: u32) {
        let Entry { prev, next, .. } = self.slots[i as usize];
        match prev {
            NIL => self.head = next,
            p => self.slots[p as usize].next = next,
        }
        match next {
            NIL => self.tail = prev,
            n => self.slots[n as usize].prev = prev,
        }
    }

    fn push_back(&mut self, i: u32) {
        self.slots[i as usize].prev = self.tail;
        self.slots[i as usize].next = NIL;
        match self.tail {
            NIL => self.head = i,
            t => self.slots[t as usize].next = i,
        }
        self.tail = i;
    }

    /// Marks `hash` most recently used; false if it is not held.
    pub fn touch(&mut self, hash: u64) -> bool {
        match self.map.get(&hash) {
            Some(&i) => {
                self.unlink(i);
                self.push_back(i);
                true
            }
            None => false,
        }
    }

    /// Stores a block evicted from the GPU. A hash already held is only touched (no event); a new
    /// one may evict the LRU entry first (`BlockRemoved` CPU), then is announced (`BlockStored`
    /// CPU placeholder).
    pub fn store(&mut self, hash: u64, events: Option<&mut Vec<KvEvent>>) {
        if self.capacity == 0 || self.touch(hash) {
            return;
        }
        let mut events = events;
        let slot = if self.map.len() >= self.capacity {
            let i = self.head;
            let old = self.slots[i as usize].hash;
            self.unlink(i);
            self.map.remove(&old);
            if let Some(ev) = events.as_deref_mut() {
                ev.push(KvEvent::Removed(BlockRemoved {
                    block_hashes: vec![old],
                    medium: Medium::Cpu,
                    group_idx: 0,
                }));
            }
            i
        } else if let Some(i) = self.free.pop() {
            i
        } else {
            self.slots.push(Entry {
                hash,
                prev: NIL,
                next: NIL,
            });
            (self.slots.len() - 1) as u32
        };
        self.slots[slot as usize].hash = hash;
        self.push_back(slot);
        self.map.insert(hash, slot);
        if let Some(ev) = events {
            ev.push(KvEvent::Stored(placeholder(hash)));
        }
    }

    /// Drops everything (engine restart; no events, as a restarted engine sends none).
    pub fn clear(&mut self) {
        self.slots.clear();
        self.free.clear();
        self.map.clear();
        self.head = NIL;
        self.tail = NIL;
    }
}

/// vLLM's default CPU `BlockStored`: the hash only.
fn placeholder(hash: u64) -> BlockStored {
    BlockStored {
        block_hashes: vec![hash],
        parent: None,
        token_ids: Vec::new(),
        block_size: 0,
        lora_id: None,
        lora_name: None,
        medium: Medium::Cpu,
        cache_salt: None,
        extra: None,
        group_idx: 0,
        spec_kind: None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lru_eviction_touch_and_events() {
        let mut cpu = CpuTier::new(2);
        let mut ev = Vec::new();
        cpu.store(1, Some(&mut ev));
        cpu.store(2, Some(&mut ev));
        assert_eq!(ev.len(), 2);
        cpu.store(1, Some(&mut ev)); // already held: touched, no event
        assert_eq!(ev.len(), 2);
        assert_eq!(cpu.lru_order(), vec![2, 1]);
        cpu.store(3, Some(&mut ev)); // evicts 2
        assert_eq!(cpu.lru_order(), vec![1, 3]);
        assert!(
            matches!(&ev[2], KvEvent::Removed(r) if r.block_hashes == [2] && r.medium == Medium::Cpu)
        );
        assert!(
            matches!(&ev[3], KvEvent::Stored(s) if s.block_hashes == [3] && s.token_ids.is_empty() && s.block_size == 0)
        );
        assert!(!cpu.contains(2));
        cpu.clear();
        assert!(cpu.is_empty());
    }

    #[test]
    fn zero_capacity_holds_nothing() {
        let mut cpu = CpuTier::new(0);
        let mut ev = Vec::new();
        cpu.store(5, Some(&mut ev));
        assert!(ev.is_empty() && cpu.is_empty());
    }
}
