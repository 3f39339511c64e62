//! Replays a Mooncake trace on simulated engines and prints the report and the wall time.
//!
//! ```text
//! cargo run --release -p kvroute-core --example replay -- \
//!     ../shared/traces/conversation_trace.jsonl [replicas] [policy] [preset] [speedup] [limit]
//! ```
use std::path::PathBuf;

use kvroute_core::sim::{replay_mooncake, ReplayConfig};

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let Some(path) = args.first().map(PathBuf::from) else {
        eprintln!("usage: replay TRACE [replicas] [policy] [preset] [speedup] [limit]");
        std::process::exit(2);
    };
    let arg = |i: usize| args.get(i).filter(|s| !s.is_empty() && *s != "-");
    let mut cfg = ReplayConfig::default();
    if let Some(r) = arg(1) {
        cfg.replicas = r.parse().expect("replicas: an integer");
    }
    if let Some(p) = arg(2) {
        cfg.policy = p.clone();
    }
    if let Some(p) = arg(3) {
        cfg.preset = p.clone();
    }
    if let Some(s) = arg(4) {
        cfg.speedup = s.parse().expect("speedup: a number");
    }
    cfg.limit = arg(5).map(|l| l.parse().expect("limit: an integer"));
    // KVROUTE_FEED_INDEX=1 applies events to the index even for policies that do not read it.
    cfg.feed_index = std::env::var("KVROUTE_FEED_INDEX").ok().map(|v| v == "1");
    let t = std::time::Instant::now();
    match replay_mooncake(&path, &cfg) {
        Ok(report) => {
            println!("policy {} preset {}", report.policy, report.preset);
            for (k, v) in report.counts() {
                println!("{k:>24} {v}");
            }
            for (k, v) in report.figures() {
                println!("{k:>24} {v:.3}");
            }
            println!(
                "{:>24} {:?}",
                "requests_per_replica", report.requests_per_replica
            );
            println!(
                "{:>24} {:.2} s",
                "total wall time",
                t.elapsed().as_secs_f64()
            );
        }
        Err(e) => {
            eprintln!("replay failed: {e}");
            std::process::exit(1);
        }
    }
}
