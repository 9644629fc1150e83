//! A criterion measurement of the benchmark thread's CPU time rather than wall time.
//!
//! wick's development machine is shared with other builds; wall time there measures the
//! load as much as the kernel. Thread CPU time (`CLOCK_THREAD_CPUTIME_ID`) counts only the
//! cycles this thread ran, so single-threaded kernel benches stay comparable across runs.
use std::time::Duration;

use criterion::measurement::{Measurement, ValueFormatter};
use criterion::Throughput;

/// CPU time of the calling thread.
pub struct ThreadCpuTime;

fn now() -> Duration {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid out-pointer; the clock id is supported on Linux.
    unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    Duration::new(ts.tv_sec as u64, ts.tv_nsec as u32)
}

impl Measurement for ThreadCpuTime {
    type Intermediate = Duration;
    type Value = Duration;

    fn start(&self) -> Duration {
        now()
    }
    fn end(&self, start: Duration) -> Duration {
        now().saturating_sub(start)
    }
    fn add(&self, a: &Duration, b: &Duration) -> Duration {
        *a + *b
    }
    fn zero(&self) -> Duration {
        Duration::ZERO
    }
    fn to_f64(&self, v: &Duration) -> f64 {
        v.as_nanos() as f64
    }
    fn formatter(&self) -> &dyn ValueFormatter {
        &CpuFormatter
    }
}

struct CpuFormatter;

impl ValueFormatter for CpuFormatter {
    fn scale_values(&self, typical_ns: f64, values: &mut [f64]) -> &'static str {
        let (div, unit) = if typical_ns < 1e3 {
            (1.0, "ns cpu")
        } else if typical_ns < 1e6 {
            (1e3, "µs cpu")
        } else if typical_ns < 1e9 {
            (1e6, "ms cpu")
        } else {
            (1e9, "s cpu")
        };
        values.iter_mut().for_each(|v| *v /= div);
        unit
    }

    fn scale_throughputs(&self, _typical: f64, t: &Throughput, values: &mut [f64]) -> &'static str {
        let per = match t {
            Throughput::Bytes(n)
            | Throughput::BytesDecimal(n)
            | Throughput::Elements(n)
            | Throughput::Bits(n) => *n as f64,
        };
        // per / ns = G per second.
        values.iter_mut().for_each(|v| *v = per / *v);
        match t {
            Throughput::Bytes(_) | Throughput::BytesDecimal(_) => "GB/s (cpu)",
            Throughput::Bits(_) => "Gbit/s (cpu)",
            Throughput::Elements(_) => "Gelem/s (cpu)",
        }
    }

    fn scale_for_machines(&self, _values: &mut [f64]) -> &'static str {
        "ns"
    }
}
