//! Arrival processes: when each request of a workload arrives, before load scaling.
//!
//! A workload keeps its order (sessions stay in order); an arrival process only rewrites the
//! timestamps. `Trace` keeps the workload's own, `Poisson` draws exponential gaps at a rate,
//! `Gaps` replays measured inter-arrival times (the Azure LLM inference traces, bursty and real,
//! as Preble does), cycling when the workload is longer, optionally rescaled to a mean rate.
use std::path::Path;

use super::request::splitmix64;
use super::trace::TraceRecord;
use crate::{Error, Result};

#[derive(Debug, Clone, PartialEq)]
pub enum Arrival {
    /// The workload's own timestamps.
    Trace,
    /// Exponential inter-arrival times at `rate` requests per second.
    Poisson { rate: f64 },
    /// Measured inter-arrival times in seconds, used in order and cycled; with `rate`, scaled so
    /// that their mean rate is `rate`.
    Gaps { gaps: Vec<f64>, rate: Option<f64> },
    /// Every request at time 0: a closed backlog, to measure the most a cluster completes.
    Burst,
    /// The workload's own times, with requests that share a timestamp spread evenly (in order)
    /// up to the next distinct one: for traces whose times are quantized (the Mooncake
    /// conversation trace records ~10 arrivals per ~3 s tick).
    TraceSpread,
}

impl Arrival {
    /// An arrival process by name: `trace`, `burst`, `poisson` (needs `rate`) or `azure` (needs
    /// `path`, an Azure trace CSV; `rate` optional).
    pub fn from_spec(kind: &str, rate: Option<f64>, path: Option<&Path>) -> Result<Self> {
        let need =
            |what: &str| Error::InvalidArgument(format!("arrival process {kind:?} needs {what}"));
        match kind {
            "trace" => Ok(Arrival::Trace),
            "burst" => Ok(Arrival::Burst),
            "trace-spread" => Ok(Arrival::TraceSpread),
            "poisson" => Ok(Arrival::Poisson {
                rate: rate.ok_or_else(|| need("a rate"))?,
            }),
            "azure" => Arrival::azure(path.ok_or_else(|| need("an Azure trace path"))?, rate),
            _ => Err(Error::InvalidArgument(format!(
                "unknown arrival process {kind:?} (known: trace, trace-spread, poisson, azure, burst)"
            ))),
        }
    }

    /// Inter-arrival times from an Azure LLM inference trace CSV (`TIMESTAMP` column first).
    pub fn azure(path: &Path, rate: Option<f64>) -> Result<Self> {
        let text = std::fs::read_to_string(path).map_err(|e| {
            Error::InvalidArgument(format!("cannot read arrivals {}: {e}", path.display()))
        })?;
        Ok(Arrival::Gaps {
            gaps: parse_azure_gaps(&text)?,
            rate,
        })
    }

    /// Rewrites the timestamps of `records` (milliseconds, first arrival at 0).
    pub fn apply(&self, records: &mut [TraceRecord], seed: u64) -> Result<()> {
        let positive = |r: f64| {
            if r.is_finite() && r > 0.0 {
                Ok(r)
            } else {
                Err(Error::InvalidArgument(format!(
                    "arrival rate must be positive, got {r}"
                )))
            }
        };
        match self {
            Arrival::Trace => {}
            Arrival::Burst => records.iter_mut().for_each(|r| r.timestamp_ms = 0.0),
            Arrival::TraceSpread => spread_ticks(records),
            Arrival::Poisson { rate } => {
                let rate = positive(*rate)?;
                let mut s = splitmix64(seed ^ 0x706f_6973_736f_6e00);
                let mut t = 0.0;
                for (i, r) in records.iter_mut().enumerate() {
                    if i > 0 {
                        s = splitmix64(s);
                        // Uniform in (0, 1], so the logarithm is finite.
                        let u = ((s >> 11) + 1) as f64 / (1u64 << 53) as f64;
                        t += -u.ln() / rate;
                    }
                    r.timestamp_ms = t * 1000.0;
                }
            }
            Arrival::Gaps { gaps, rate } => {
                if gaps.is_empty() {
                    return Err(Error::InvalidArgument(
                        "no inter-arrival times to replay".into(),
                    ));
                }
                let mean = gaps.iter().sum::<f64>() / gaps.len() as f64;
                let scale = match rate {
                    Some(r) if mean > 0.0 => 1.0 / (positive(*r)? * mean),
                    _ => 1.0,
                };
                let mut t = 0.0;
                for (i, r) in records.iter_mut().enumerate() {
                    if i > 0 {
                        t += gaps[(i - 1) % gaps.len()] * scale;
                    }
                    r.timestamp_ms = t * 1000.0;
                }
            }
        }
        Ok(())
    }
}

/// Spreads each run of equal timestamps evenly over the gap to the next distinct one (the last
/// run over the mean gap between distinct timestamps).
fn spread_ticks(records: &mut [TraceRecord]) {
    let n = records.len();
    let distinct: Vec<f64> = {
        let mut d: Vec<f64> = records.iter().map(|r| r.timestamp_ms).collect();
        d.dedup();
        d
    };
    let mean_gap = if distinct.len() > 1 {
        (distinct[distinct.len() - 1] - distinct[0]) / (distinct.len() - 1) as f64
    } else {
        0.0
    };
    let mut i = 0;
    while i < n {
        let t = records[i].timestamp_ms;
        let j = (i..n).find(|&j| records[j].timestamp_ms != t).unwrap_or(n);
        let gap = if j < n {
            records[j].timestamp_ms - t
        } else {
            mean_gap
        };
        let k = (j - i) as f64;
        for (m, r) in records[i..j].iter_mut().enumerate() {
            r.timestamp_ms = t + gap * m as f64 / k;
        }
        i = j;
    }
}

/// Seconds since midnight of `YYYY-MM-DD HH:MM:SS[.fffffff]`, plus 86,400 per day of month (a
/// trace spans hours, so day-of-month arithmetic is enough within one month).
fn parse_timestamp(s: &str) -> Option<f64> {
    let (date, time) = s.trim().split_once(' ')?;
    let day: f64 = date.rsplit('-').next()?.parse().ok()?;
    let mut parts = time.split(':');
    let h: f64 = parts.next()?.parse().ok()?;
    let m: f64 = parts.next()?.parse().ok()?;
    let sec: f64 = parts.next()?.parse().ok()?;
    Some(day * 86_400.0 + h * 3600.0 + m * 60.0 + sec)
}

/// Inter-arrival times (seconds, in file order, negative gaps clamped to 0) of an Azure CSV.
pub fn parse_azure_gaps(text: &str) -> Result<Vec<f64>> {
    let mut times = Vec::new();
    for (i, line) in text.lines().enumerate() {
        let field = line.split(',').next().unwrap_or("");
        if i == 0 && field.trim().eq_ignore_ascii_case("timestamp") || line.trim().is_empty() {
            continue;
        }
        let t = parse_timestamp(field).ok_or_else(|| {
            Error::InvalidArgument(format!("arrivals line {}: bad timestamp {field:?}", i + 1))
        })?;
        times.push(t);
    }
    if times.len() < 2 {
        return Err(Error::InvalidArgument(
            "an arrival trace needs at least two timestamps".into(),
        ));
    }
    Ok(times.windows(2).map(|w| (w[1] - w[0]).max(0.0)).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn records(n: usize) -> Vec<TraceRecord> {
        (0..n)
            .map(|i| TraceRecord {
                timestamp_ms: i as f64 * 7.0,
                input_length: 10,
                output_length: 1,
                hash_ids: vec![i as u64],
            })
            .collect()
    }

    #[test]
    fn trace_keeps_and_poisson_draws_at_the_rate() {
        let mut r = records(20_000);
        Arrival::Trace.apply(&mut r, 0).unwrap();
        assert_eq!(r[3].timestamp_ms, 21.0);
        Arrival::Poisson { rate: 50.0 }.apply(&mut r, 1).unwrap();
        assert_eq!(r[0].timestamp_ms, 0.0);
        assert!(r.windows(2).all(|w| w[1].timestamp_ms >= w[0].timestamp_ms));
        let rate = 19_999.0 / (r.last().unwrap().timestamp_ms / 1000.0);
        assert!((rate / 50.0 - 1.0).abs() < 0.03, "{rate}");
        // Exponential gaps: the coefficient of variation is about 1.
        let gaps: Vec<f64> = r
            .windows(2)
            .map(|w| w[1].timestamp_ms - w[0].timestamp_ms)
            .collect();
        let m = gaps.iter().sum::<f64>() / gaps.len() as f64;
        let sd = (gaps.iter().map(|g| (g - m).powi(2)).sum::<f64>() / gaps.len() as f64).sqrt();
        assert!((sd / m - 1.0).abs() < 0.05, "cv {}", sd / m);
        let mut again = records(20_000);
        Arrival::Poisson { rate: 50.0 }
            .apply(&mut again, 1)
            .unwrap();
        assert_eq!(again, r, "seeded");
        assert!(Arrival::Poisson { rate: 0.0 }.apply(&mut r, 1).is_err());
    }

    #[test]
    fn ticks_are_spread_up_to_the_next_one() {
        let mut r = records(6);
        for (x, t) in r.iter_mut().zip([0.0, 0.0, 0.0, 300.0, 600.0, 600.0]) {
            x.timestamp_ms = t;
        }
        Arrival::TraceSpread.apply(&mut r, 0).unwrap();
        let ts: Vec<f64> = r.iter().map(|x| x.timestamp_ms).collect();
        assert_eq!(ts, vec![0.0, 100.0, 200.0, 300.0, 600.0, 750.0]);
        assert_eq!(
            Arrival::from_spec("trace-spread", None, None).unwrap(),
            Arrival::TraceSpread
        );
        assert!(Arrival::from_spec("poisson", None, None).is_err());
        assert!(Arrival::from_spec("nope", None, None).is_err());
    }

    #[test]
    fn azure_gaps_are_parsed_cycled_and_rescaled() {
        let csv = "TIMESTAMP,ContextTokens,GeneratedTokens\n\
                   2023-11-16 18:15:46.5000000,374,44\n\
                   2023-11-16 18:15:47.0000000,396,109\n\
                   2023-11-16 18:15:48.5000000,1,1\n";
        let gaps = parse_azure_gaps(csv).unwrap();
        assert_eq!(gaps, vec![0.5, 1.5]);
        let mut r = records(5);
        let a = Arrival::Gaps { gaps, rate: None };
        a.apply(&mut r, 0).unwrap();
        let ts: Vec<f64> = r.iter().map(|x| x.timestamp_ms).collect();
        assert_eq!(ts, vec![0.0, 500.0, 2000.0, 2500.0, 4000.0]);
        let Arrival::Gaps { gaps, .. } = a else {
            unreachable!()
        };
        // Mean gap 1 s; at 4 req/s every gap is a quarter.
        Arrival::Gaps {
            gaps,
            rate: Some(4.0),
        }
        .apply(&mut r, 0)
        .unwrap();
        assert_eq!(r[2].timestamp_ms, 500.0);
        assert!(parse_azure_gaps("TIMESTAMP\nyesterday\n").is_err());
        assert!(parse_azure_gaps("TIMESTAMP\n2023-11-16 18:15:46.5\n").is_err());
    }

    #[test]
    fn the_shipped_azure_traces_parse() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../../shared/traces");
        for (file, n, rate) in [
            ("AzureLLMInferenceTrace_conv.csv", 19_365, 5.53),
            ("AzureLLMInferenceTrace_code.csv", 8_818, 2.57),
        ] {
            let Ok(Arrival::Gaps { gaps, .. }) = Arrival::azure(&dir.join(file), None) else {
                panic!("{file} ships in shared/traces");
            };
            assert_eq!(gaps.len(), n);
            let got = n as f64 / gaps.iter().sum::<f64>();
            assert!((got / rate - 1.0).abs() < 0.05, "{file}: {got}");
        }
    }
}
