//! The machine's roofline, measured: FMA peak (a SIMD microbenchmark with
//! enough independent accumulators to fill both FMA pipes) and memory
//! bandwidth (a STREAM-like triad over arrays far larger than the caches).
//! Reports divide by these, so "percent of peak" means this machine: the
//! FMA loop runs on the widest vectors the CPU has (detected at run time,
//! as attn-cpu's kernels are), whatever the build's target features.

use rayon::prelude::*;
use std::hint::black_box;
use std::time::Instant;

/// Chains of FMAs in flight: 4-cycle latency x 2 pipes needs 8; more
/// hides any scheduling slack. 12 registers of accumulators fit AVX2's 16
/// (and AVX-512's 32 with room to spare).
const CHAINS: usize = 12;

/// FLOP/s of `iters` rounds of `CHAINS` independent FMAs on the widest
/// vectors this CPU runs.
fn fma_loop(iters: usize) -> f64 {
    #[cfg(target_arch = "x86_64")]
    {
        if is_x86_feature_detected!("avx512f") {
            // SAFETY: the CPU runs AVX-512F (checked).
            return unsafe { x86::fma_loop_avx512(iters) };
        }
        if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
            // SAFETY: the CPU runs AVX2 and FMA (checked).
            return unsafe { x86::fma_loop_avx2(iters) };
        }
    }
    fma_loop_portable(iters)
}

/// The FMA loop on `wide`'s baseline vectors (mul and add where the
/// target has no FMA).
fn fma_loop_portable(iters: usize) -> f64 {
    use wide::f32x4;
    let a = f32x4::splat(0.999_999_9);
    let b = f32x4::splat(1e-7);
    let mut acc = [f32x4::splat(1.0); CHAINS];
    let t = Instant::now();
    // Opaque from here on: the loop cannot move before or after the clock.
    black_box(&mut acc);
    for _ in 0..iters {
        for x in acc.iter_mut() {
            *x = x.mul_add(a, b);
        }
    }
    black_box(&acc);
    (iters * CHAINS * 4 * 2) as f64 / t.elapsed().as_secs_f64()
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::CHAINS;
    use std::arch::x86_64::*;
    use std::hint::black_box;
    use std::time::Instant;

    /// [`super::fma_loop`] on 256-bit registers.
    ///
    /// # Safety
    /// The CPU must run AVX2 and FMA.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn fma_loop_avx2(iters: usize) -> f64 {
        let (a, b) = (_mm256_set1_ps(0.999_999_9), _mm256_set1_ps(1e-7));
        let mut acc = [_mm256_set1_ps(1.0); CHAINS];
        let t = Instant::now();
        // Opaque from here on: the loop cannot move before or after the clock.
        black_box(&mut acc);
        for _ in 0..iters {
            for x in acc.iter_mut() {
                *x = _mm256_fmadd_ps(*x, a, b);
            }
        }
        black_box(&acc);
        (iters * CHAINS * 8 * 2) as f64 / t.elapsed().as_secs_f64()
    }

    /// [`super::fma_loop`] on 512-bit registers.
    ///
    /// # Safety
    /// The CPU must run AVX-512F.
    #[target_feature(enable = "avx512f")]
    pub unsafe fn fma_loop_avx512(iters: usize) -> f64 {
        let (a, b) = (_mm512_set1_ps(0.999_999_9), _mm512_set1_ps(1e-7));
        let mut acc = [_mm512_set1_ps(1.0); 2 * CHAINS];
        let t = Instant::now();
        // Opaque from here on: the loop cannot move before or after the clock.
        black_box(&mut acc);
        for _ in 0..iters {
            for x in acc.iter_mut() {
                *x = _mm512_fmadd_ps(*x, a, b);
            }
        }
        black_box(&acc);
        (iters * 2 * CHAINS * 16 * 2) as f64 / t.elapsed().as_secs_f64()
    }
}

/// Peak f32 FMA throughput of one core in GFLOP/s (best of several runs).
pub fn fma_peak_per_core() -> f64 {
    (0..7)
        .map(|_| fma_loop(black_box(4_000_000)))
        .fold(0.0, f64::max)
        / 1e9
}

/// A rayon pool of `threads` threads for one measurement.
fn pool(threads: usize) -> rayon::ThreadPool {
    rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()
        .expect("thread pool")
}

/// Peak f32 FMA throughput with `threads` threads in GFLOP/s (each thread
/// runs the one-core loop; the sum of their rates).
pub fn fma_peak(threads: usize) -> f64 {
    let pool = pool(threads);
    (0..5)
        .map(|_| {
            pool.install(|| {
                (0..threads)
                    .into_par_iter()
                    .map(|_| fma_loop(black_box(4_000_000)))
                    .sum::<f64>()
            })
        })
        .fold(0.0, f64::max)
        / 1e9
}

/// Memory bandwidth in GB/s: triad `a = b + s * c` over 3 x 64 MiB, counting
/// 3 arrays of traffic per pass, best of several passes, `threads` threads.
pub fn triad_bandwidth(threads: usize) -> f64 {
    let n = 16 << 20;
    let pool = pool(threads);
    pool.install(|| {
        let mut a = vec![0.0f32; n];
        let b = vec![1.0f32; n];
        let c = vec![2.0f32; n];
        let chunk = n / threads.max(1) / 8;
        let mut best = 0.0f64;
        for _ in 0..6 {
            let t = Instant::now();
            a.par_chunks_mut(chunk)
                .zip(b.par_chunks(chunk))
                .zip(c.par_chunks(chunk))
                .for_each(|((a, b), c)| {
                    for i in 0..a.len() {
                        a[i] = b[i] + 3.0 * c[i];
                    }
                });
            black_box(&a);
            let s = t.elapsed().as_secs_f64();
            best = best.max((3 * n * 4) as f64 / s / 1e9);
        }
        best
    })
}

/// Read bandwidth in GB/s: each of `threads` threads sums its part of a
/// 256 MiB f32 array (well beyond the caches), best of several passes. The
/// roofline of a kernel that only reads its data, as decoding reads K and
/// V; triad (`triad_bandwidth`) also writes, and counts 3 arrays where the
/// hardware moves 4 (the written lines are read first).
pub fn read_bandwidth(threads: usize) -> f64 {
    let n = 64 << 20;
    let pool = pool(threads);
    pool.install(|| {
        let a: Vec<f32> = (0..n).map(|i| (i % 7) as f32).collect();
        let chunk = n / threads.max(1) / 8;
        let mut best = 0.0f64;
        for _ in 0..6 {
            let t = Instant::now();
            let total: f32 = a.par_chunks(chunk).map(sum_lines).sum();
            black_box(total);
            let s = t.elapsed().as_secs_f64();
            best = best.max((n * 4) as f64 / s / 1e9);
        }
        best
    })
}

/// The sum of `a`, 64 independent partial sums at a time (4 cache lines per
/// step), which the compiler keeps in vector registers.
fn sum_lines(a: &[f32]) -> f32 {
    let mut acc = [0.0f32; 64];
    let mut lines = a.chunks_exact(64);
    for c in &mut lines {
        for (x, &y) in acc.iter_mut().zip(c) {
            *x += y;
        }
    }
    acc.iter().sum::<f32>() + lines.remainder().iter().sum::<f32>()
}
