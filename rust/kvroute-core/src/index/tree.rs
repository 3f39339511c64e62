//! The radix tree behind [`super::PrefixIndex`].
//!
//! A node is a *run*: a chain of blocks that all have the same residency (the same workers, with
//! the same copy counts per tier and the same speculative deadline) and no branch inside. Matching
//! a request therefore costs one child lookup per run and a sequential comparison of u64 content
//! hashes inside it, instead of one hash-map probe per block; and residency is stored once per run,
//! not once per block, which is what keeps memory per (block, worker) entry low.
//!
//! Invariants (checked by `check_invariants` in tests):
//! * every node but the root holds at least one block; the root holds none;
//! * `blocks[id]` points at the node and offset that hold block `id`;
//! * a child's first content hash is its key in the parent's child table;
//! * `res` is sorted by slot, holds no all-zero entry, and `entries` equals the sum over nodes of
//!   `len * res.len()`;
//! * a node with no residency has children (empty leaves are pruned at once).
use hashbrown::HashMap;
use smallvec::SmallVec;

use crate::Nanos;

pub(crate) type NodeId = u32;
pub(crate) type BlockId = u32;
pub(crate) const ROOT: NodeId = 0;
/// Children kept in a small vector up to this many, then in a hash map.
const FEW_CHILDREN: usize = 8;

/// The residency of one worker (by slot) on every block of a run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Res {
    pub slot: u16,
    /// Copies cached in GPU memory (vLLM can cache one hash twice).
    pub gpu: u16,
    /// Copies in the CPU offload tier.
    pub cpu: u16,
    /// Speculative residency, recorded by the router, alive while `now < spec_until`.
    pub spec_until: Nanos,
}

impl Res {
    fn is_empty(&self) -> bool {
        self.gpu == 0 && self.cpu == 0 && self.spec_until == 0
    }
}

pub(crate) type ResVec = SmallVec<[Res; 2]>;

#[derive(Debug, Clone)]
pub(crate) enum Children {
    Few(SmallVec<[(u64, NodeId); 2]>),
    Many(HashMap<u64, NodeId>),
}

impl Children {
    pub fn get(&self, h: u64) -> Option<NodeId> {
        match self {
            Children::Few(v) => v.iter().find(|(k, _)| *k == h).map(|(_, n)| *n),
            Children::Many(m) => m.get(&h).copied(),
        }
    }
    fn insert(&mut self, h: u64, n: NodeId) {
        match self {
            Children::Few(v) => {
                if let Some(e) = v.iter_mut().find(|(k, _)| *k == h) {
                    e.1 = n;
                } else if v.len() < FEW_CHILDREN {
                    v.push((h, n));
                } else {
                    let mut m: HashMap<u64, NodeId> = v.iter().copied().collect();
                    m.insert(h, n);
                    *self = Children::Many(m);
                }
            }
            Children::Many(m) => {
                m.insert(h, n);
            }
        }
    }
    fn remove(&mut self, h: u64) {
        match self {
            Children::Few(v) => v.retain(|(k, _)| *k != h),
            Children::Many(m) => {
                m.remove(&h);
            }
        }
    }
    pub fn len(&self) -> usize {
        match self {
            Children::Few(v) => v.len(),
            Children::Many(m) => m.len(),
        }
    }
    pub fn ids(&self) -> SmallVec<[NodeId; 8]> {
        match self {
            Children::Few(v) => v.iter().map(|(_, n)| *n).collect(),
            Children::Many(m) => m.values().copied().collect(),
        }
    }
    fn only(&self) -> Option<NodeId> {
        match self {
            Children::Few(v) if v.len() == 1 => Some(v[0].1),
            _ => None,
        }
    }
    fn heap_bytes(&self) -> usize {
        match self {
            Children::Few(v) if v.spilled() => v.capacity() * 16,
            Children::Few(_) => 0,
            Children::Many(m) => m.allocation_size(),
        }
    }
}

#[derive(Debug, Clone)]
pub(crate) struct Node {
    pub parent: NodeId,
    pub hashes: Vec<u64>,
    pub ids: Vec<BlockId>,
    pub res: ResVec,
    pub children: Children,
    /// Logical time of the last match or store that touched this run (LRU for the budget).
    pub last_used: u64,
    pub live: bool,
}

impl Node {
    fn new(parent: NodeId) -> Self {
        Node {
            parent,
            hashes: Vec::new(),
            ids: Vec::new(),
            res: ResVec::new(),
            children: Children::Few(SmallVec::new()),
            last_used: 0,
            live: true,
        }
    }
    pub fn len(&self) -> usize {
        self.hashes.len()
    }
    pub fn res_of(&self, slot: u16) -> Option<&Res> {
        self.res.iter().find(|r| r.slot == slot)
    }
}

/// An engine hash as a hash-map key aligned to 4 bytes, so that a (key, block id) bucket takes
/// 12 bytes instead of 16: the engine map holds one bucket per block.
#[repr(C, packed(4))]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
struct EngineKey(u64);

/// Engine hash -> block.
#[derive(Debug, Default)]
pub(crate) struct EngineMap(HashMap<EngineKey, BlockId>);

impl EngineMap {
    pub fn get(&self, e: &u64) -> Option<&BlockId> {
        self.0.get(&EngineKey(*e))
    }
    fn insert(&mut self, e: u64, b: BlockId) {
        self.0.insert(EngineKey(e), b);
    }
    fn remove(&mut self, e: &u64) {
        self.0.remove(&EngineKey(*e));
    }
    fn allocation_size(&self) -> usize {
        self.0.allocation_size()
    }
    fn iter(&self) -> impl Iterator<Item = (u64, BlockId)> + '_ {
        self.0.iter().map(|(k, b)| ({ k.0 }, *b))
    }
}

#[derive(Debug, Clone, Copy)]
pub(crate) struct BlockInfo {
    pub node: NodeId,
    pub off: u32,
    /// The engine hash first reported for this block (0 = none yet, e.g. speculative only).
    pub engine: u64,
}

/// What a walk does to the residency of the blocks it covers.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Op {
    /// A real copy cached on the GPU (`cpu == false`) or in the CPU tier.
    Store { cpu: bool },
    /// A speculative entry alive until the given time.
    Speculate { until: Nanos },
}

#[derive(Debug, Default)]
pub(crate) struct Tree {
    pub nodes: Vec<Node>,
    free_nodes: Vec<NodeId>,
    pub blocks: Vec<BlockInfo>,
    free_blocks: Vec<BlockId>,
    /// Engine hash -> block, shared by all workers: with vLLM's fixed seed every replica reports
    /// the same engine hash for the same content; replicas that disagree just add aliases.
    pub engine: EngineMap,
    /// Extra engine hashes of a block beyond `BlockInfo::engine` (rare).
    aliases: HashMap<BlockId, SmallVec<[u64; 2]>>,
    /// Sum over nodes of `len * res.len()`: resident (block, worker) entries.
    pub entries: u64,
    /// Per slot: resident blocks (any tier, speculative included).
    pub slot_entries: Vec<u64>,
    pub clock: u64,
}

impl Tree {
    pub fn new() -> Self {
        let mut t = Tree::default();
        t.nodes.push(Node::new(ROOT));
        t
    }

    pub fn block_count(&self) -> usize {
        self.blocks.len() - self.free_blocks.len()
    }

    pub fn node_count(&self) -> usize {
        self.nodes.len() - self.free_nodes.len() - 1
    }

    fn alloc_node(&mut self, parent: NodeId) -> NodeId {
        if let Some(id) = self.free_nodes.pop() {
            self.nodes[id as usize] = Node::new(parent);
            id
        } else {
            self.nodes.push(Node::new(parent));
            (self.nodes.len() - 1) as NodeId
        }
    }

    fn alloc_block(&mut self, node: NodeId, off: u32, engine: u64) -> BlockId {
        let info = BlockInfo { node, off, engine };
        if let Some(id) = self.free_blocks.pop() {
            self.blocks[id as usize] = info;
            id
        } else {
            self.blocks.push(info);
            (self.blocks.len() - 1) as BlockId
        }
    }

    fn count_res(&mut self, node: NodeId, sign: i64) {
        let n = &self.nodes[node as usize];
        let len = n.len() as u64;
        for r in &n.res {
            let e = &mut self.slot_entries[r.slot as usize];
            if sign > 0 {
                *e += len;
            } else {
                *e -= len;
            }
        }
        let total = len * n.res.len() as u64;
        if sign > 0 {
            self.entries += total;
        } else {
            self.entries -= total;
        }
    }

    /// Splits `node` before offset `k` (0 < k < len): the tail becomes a new single child.
    fn split(&mut self, node: NodeId, k: usize) -> NodeId {
        debug_assert!(k > 0 && k < self.nodes[node as usize].len());
        let tail = self.alloc_node(node);
        let n = &mut self.nodes[node as usize];
        let hashes = n.hashes.split_off(k);
        let ids = n.ids.split_off(k);
        let res = n.res.clone();
        let last_used = n.last_used;
        let first = hashes[0];
        let children = std::mem::replace(&mut n.children, Children::Few(SmallVec::new()));
        n.children.insert(first, tail);
        n.hashes.shrink_to_fit();
        n.ids.shrink_to_fit();
        for c in children.ids() {
            self.nodes[c as usize].parent = tail;
        }
        for (off, &b) in ids.iter().enumerate() {
            let info = &mut self.blocks[b as usize];
            info.node = tail;
            info.off = off as u32;
        }
        let t = &mut self.nodes[tail as usize];
        t.hashes = hashes;
        t.ids = ids;
        t.res = res;
        t.children = children;
        t.last_used = last_used;
        tail
    }

    /// Makes blocks `[a, b)` of `node` a node of their own and returns it.
    pub fn isolate(&mut self, node: NodeId, a: usize, b: usize) -> NodeId {
        let len = self.nodes[node as usize].len();
        debug_assert!(a < b && b <= len);
        if b < len {
            self.split(node, b);
        }
        if a > 0 {
            self.split(node, a)
        } else {
            node
        }
    }

    /// Applies `op` (or its removal, `add == false`) for `slot` to every block of `node`.
    /// Returns false when a removal found nothing to remove.
    pub fn update_res(&mut self, node: NodeId, slot: u16, op: Op, add: bool, now: Nanos) -> bool {
        self.count_res(node, -1);
        let n = &mut self.nodes[node as usize];
        let pos = n.res.iter().position(|r| r.slot == slot);
        let mut changed = true;
        match (pos, add) {
            (None, false) => changed = false,
            (None, true) => {
                let mut r = Res {
                    slot,
                    gpu: 0,
                    cpu: 0,
                    spec_until: 0,
                };
                apply_op(&mut r, op, true, now);
                let at = n
                    .res
                    .iter()
                    .position(|x| x.slot > slot)
                    .unwrap_or(n.res.len());
                n.res.insert(at, r);
            }
            (Some(i), _) => {
                changed = apply_op(&mut n.res[i], op, add, now);
                if n.res[i].is_empty() {
                    n.res.remove(i);
                }
            }
        }
        self.count_res(node, 1);
        changed
    }

    /// Drops `slot` from every node (worker cleared or removed). Prunes emptied leaves.
    pub fn purge_slot(&mut self, slot: u16) -> u64 {
        let before = self.slot_entries.get(slot as usize).copied().unwrap_or(0);
        let mut emptied = Vec::new();
        for id in 1..self.nodes.len() as NodeId {
            if !self.nodes[id as usize].live || self.nodes[id as usize].res_of(slot).is_none() {
                continue;
            }
            self.count_res(id, -1);
            self.nodes[id as usize].res.retain(|r| r.slot != slot);
            self.count_res(id, 1);
            if self.nodes[id as usize].res.is_empty() {
                emptied.push(id);
            }
        }
        for id in emptied {
            self.prune(id);
        }
        before
    }

    /// Deletes `node` and then its ancestors while they are empty leaves.
    pub fn prune(&mut self, mut node: NodeId) {
        while node != ROOT {
            let n = &self.nodes[node as usize];
            if !n.live || !n.res.is_empty() || n.children.len() > 0 {
                return;
            }
            let parent = n.parent;
            self.delete_leaf(node);
            node = parent;
        }
    }

    /// Removes a leaf with all its blocks (whatever its residency).
    pub fn delete_leaf(&mut self, node: NodeId) {
        self.count_res(node, -1);
        let n = &mut self.nodes[node as usize];
        debug_assert!(n.children.len() == 0 && node != ROOT);
        n.live = false;
        let parent = n.parent;
        let first = n.hashes[0];
        let ids = std::mem::take(&mut n.ids);
        n.hashes = Vec::new();
        n.res = ResVec::new();
        self.nodes[parent as usize].children.remove(first);
        for b in ids {
            self.free_block(b);
        }
        self.free_nodes.push(node);
    }

    /// Forgets block `b` (its engine hashes included) and recycles its id.
    fn free_block(&mut self, b: BlockId) {
        let eng = self.blocks[b as usize].engine;
        if eng != 0 && self.engine.get(&eng) == Some(&b) {
            self.engine.remove(&eng);
        }
        if let Some(al) = self.aliases.remove(&b) {
            for e in al {
                if self.engine.get(&e) == Some(&b) {
                    self.engine.remove(&e);
                }
            }
        }
        self.free_blocks.push(b);
    }

    /// Drops the last block of the leaf `node` (the common eviction: vLLM evicts tails first),
    /// deleting the node, and pruning up, when it was the only block.
    pub fn pop_last(&mut self, node: NodeId) {
        debug_assert!(node != ROOT && self.nodes[node as usize].children.len() == 0);
        if self.nodes[node as usize].len() == 1 {
            let parent = self.nodes[node as usize].parent;
            self.delete_leaf(node);
            self.prune(parent);
            return;
        }
        self.count_res(node, -1);
        let n = &mut self.nodes[node as usize];
        n.hashes.pop();
        let b = n.ids.pop().expect("a non-empty run");
        self.count_res(node, 1);
        self.free_block(b);
    }

    /// Merges `node` with its single child, and its parent with it, where residency agrees.
    pub fn merge_around(&mut self, node: NodeId) {
        if !self.nodes[node as usize].live {
            return;
        }
        let parent = self.nodes[node as usize].parent;
        if node != ROOT && parent != ROOT && self.mergeable(parent, node) {
            self.absorb(parent, node);
            self.merge_around(parent);
            return;
        }
        if node != ROOT {
            if let Some(child) = self.nodes[node as usize].children.only() {
                if self.mergeable(node, child) {
                    self.absorb(node, child);
                }
            }
        }
    }

    fn mergeable(&self, parent: NodeId, child: NodeId) -> bool {
        let p = &self.nodes[parent as usize];
        p.children.only() == Some(child) && p.res == self.nodes[child as usize].res
    }

    /// Appends the single child `child` to `node`.
    fn absorb(&mut self, node: NodeId, child: NodeId) {
        let c = &mut self.nodes[child as usize];
        let hashes = std::mem::take(&mut c.hashes);
        let ids = std::mem::take(&mut c.ids);
        let children = std::mem::replace(&mut c.children, Children::Few(SmallVec::new()));
        let last_used = c.last_used;
        c.live = false;
        c.res = ResVec::new();
        self.free_nodes.push(child);
        let base = self.nodes[node as usize].len();
        for (i, &b) in ids.iter().enumerate() {
            let info = &mut self.blocks[b as usize];
            info.node = node;
            info.off = (base + i) as u32;
        }
        for g in children.ids() {
            self.nodes[g as usize].parent = node;
        }
        let n = &mut self.nodes[node as usize];
        // Exact growth: runs grow a chunk at a time and live long, so doubling would leave
        // a quarter of their memory unused on average.
        n.hashes.reserve_exact(hashes.len());
        n.hashes.extend_from_slice(&hashes);
        n.ids.reserve_exact(ids.len());
        n.ids.extend_from_slice(&ids);
        n.children = children;
        n.last_used = n.last_used.max(last_used);
    }

    /// Records that `block` also carries engine hash `eng`.
    pub fn bind_engine(&mut self, block: BlockId, eng: u64) {
        if eng == 0 {
            return;
        }
        let info = &mut self.blocks[block as usize];
        if info.engine == 0 {
            info.engine = eng;
        } else if info.engine != eng {
            let al = self.aliases.entry(block).or_default();
            if !al.contains(&eng) {
                al.push(eng);
            }
        }
        self.engine.insert(eng, block);
    }

    /// Walks `hashes` from position (`node`, `off`) — `off` blocks of `node` already consumed —
    /// applying `op` for `slot` to every block, creating the blocks that do not exist yet.
    /// `engines`, when given, are the engine hashes of the blocks, parallel to `hashes`.
    /// Returns the node holding the last block.
    pub fn insert_chain(
        &mut self,
        slot: u16,
        start: (NodeId, usize),
        hashes: &[u64],
        engines: Option<&[u64]>,
        op: Op,
        now: Nanos,
    ) -> NodeId {
        let (mut node, mut off) = start;
        let mut i = 0;
        let n = hashes.len();
        let mut touched: SmallVec<[NodeId; 8]> = SmallVec::new();
        let tick = self.clock;
        while i < n {
            let len = self.nodes[node as usize].len();
            if off < len {
                let s = off;
                let mut e = off;
                while e < len && i < n && self.nodes[node as usize].hashes[e] == hashes[i] {
                    if let Some(eng) = engines {
                        let b = self.nodes[node as usize].ids[e];
                        self.bind_engine(b, eng[i]);
                    }
                    e += 1;
                    i += 1;
                }
                if e == s {
                    // Diverges inside the run: cut it here and branch.
                    self.split(node, s);
                    break;
                }
                let seg = self.isolate(node, s, e);
                self.update_res(seg, slot, op, true, now);
                self.nodes[seg as usize].last_used = tick;
                touched.push(seg);
                node = seg;
                off = e - s;
                continue;
            }
            match self.nodes[node as usize].children.get(hashes[i]) {
                Some(c) => {
                    node = c;
                    off = 0;
                }
                None => break,
            }
        }
        if i < n {
            let new = self.alloc_node(node);
            let mut ids = Vec::with_capacity(n - i);
            for (k, j) in (i..n).enumerate() {
                let b = self.alloc_block(new, k as u32, 0);
                if let Some(eng) = engines {
                    self.bind_engine(b, eng[j]);
                }
                ids.push(b);
            }
            let mut r = Res {
                slot,
                gpu: 0,
                cpu: 0,
                spec_until: 0,
            };
            apply_op(&mut r, op, true, now);
            let nn = &mut self.nodes[new as usize];
            nn.hashes = hashes[i..].to_vec();
            nn.ids = ids;
            nn.res.push(r);
            nn.last_used = tick;
            self.count_res(new, 1);
            self.nodes[node as usize].children.insert(hashes[i], new);
            touched.push(new);
            node = new;
        }
        let last = node;
        for t in touched {
            self.merge_around(t);
        }
        // `last` may have been absorbed into its parent by a merge.
        if self.nodes[last as usize].live {
            last
        } else {
            ROOT
        }
    }

    /// The node and offset of the position right after block `b`.
    pub fn after_block(&self, b: BlockId) -> (NodeId, usize) {
        let info = self.blocks[b as usize];
        (info.node, info.off as usize + 1)
    }

    pub fn heap_bytes(&self) -> usize {
        let mut total = self.nodes.capacity() * std::mem::size_of::<Node>()
            + self.blocks.capacity() * std::mem::size_of::<BlockInfo>()
            + self.engine.allocation_size()
            + self.aliases.allocation_size()
            + (self.free_blocks.capacity() + self.free_nodes.capacity()) * 4;
        for n in &self.nodes {
            total += n.hashes.capacity() * 8 + n.ids.capacity() * 4 + n.children.heap_bytes();
            if n.res.spilled() {
                total += n.res.capacity() * std::mem::size_of::<Res>();
            }
        }
        total
    }
}

/// Applies or reverts `op` on one residency entry; false when a revert had nothing to revert.
fn apply_op(r: &mut Res, op: Op, add: bool, now: Nanos) -> bool {
    match (op, add) {
        (Op::Store { cpu: false }, true) => {
            r.gpu = r.gpu.saturating_add(1);
            // A real copy replaces the router's guess.
            r.spec_until = 0;
        }
        (Op::Store { cpu: true }, true) => r.cpu = r.cpu.saturating_add(1),
        (Op::Speculate { until }, true) => {
            if r.gpu == 0 {
                r.spec_until = r.spec_until.max(until);
            }
        }
        (Op::Store { cpu: false }, false) => {
            if r.gpu == 0 {
                return false;
            }
            r.gpu -= 1;
        }
        (Op::Store { cpu: true }, false) => {
            if r.cpu == 0 {
                return false;
            }
            r.cpu -= 1;
        }
        (Op::Speculate { .. }, false) => {
            if r.spec_until == 0 || r.spec_until > now {
                return false;
            }
            r.spec_until = 0;
        }
    }
    true
}

impl Tree {
    pub fn check_invariants(&self) -> Result<(), String> {
        let mut entries = 0u64;
        let mut slot_entries = vec![0u64; self.slot_entries.len()];
        let mut seen_blocks = 0usize;
        for (id, n) in self.nodes.iter().enumerate() {
            let id = id as NodeId;
            if !n.live {
                continue;
            }
            if id == ROOT {
                if n.len() != 0 || !n.res.is_empty() {
                    return Err("root holds blocks".into());
                }
            } else {
                if n.len() == 0 || n.len() != n.ids.len() {
                    return Err(format!("node {id}: bad run length"));
                }
                let p = &self.nodes[n.parent as usize];
                if !p.live || p.children.get(n.hashes[0]) != Some(id) {
                    return Err(format!("node {id}: not its parent's child"));
                }
                if n.res.is_empty() && n.children.len() == 0 {
                    return Err(format!("node {id}: empty leaf"));
                }
            }
            for w in n.res.windows(2) {
                if w[0].slot >= w[1].slot {
                    return Err(format!("node {id}: residency not sorted"));
                }
            }
            for r in &n.res {
                if r.is_empty() {
                    return Err(format!("node {id}: empty residency entry"));
                }
                slot_entries[r.slot as usize] += n.len() as u64;
            }
            entries += (n.len() * n.res.len()) as u64;
            for (off, &b) in n.ids.iter().enumerate() {
                let info = self.blocks[b as usize];
                if info.node != id || info.off as usize != off {
                    return Err(format!("block {b}: location is stale"));
                }
                seen_blocks += 1;
            }
            for c in n.children.ids() {
                let cn = &self.nodes[c as usize];
                if !cn.live || cn.parent != id {
                    return Err(format!("node {id}: child {c} does not point back"));
                }
            }
        }
        if entries != self.entries || slot_entries != self.slot_entries {
            return Err(format!(
                "entry counts drifted: {entries} vs {}",
                self.entries
            ));
        }
        if seen_blocks != self.block_count() {
            return Err(format!(
                "{seen_blocks} blocks in nodes, {} allocated",
                self.block_count()
            ));
        }
        for (e, b) in self.engine.iter() {
            let info = self.blocks[b as usize];
            if !self.nodes[info.node as usize].live {
                return Err(format!("engine hash {e:#x} points at a dead block"));
            }
        }
        Ok(())
    }
}
