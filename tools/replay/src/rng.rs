//! A tiny deterministic PRNG (SplitMix64) and the few distributions the tool
//! needs. Hand-rolled rather than a crate so a `--seed` gives byte-identical
//! traces and target choices on every platform and toolchain, forever: the
//! workload is part of what a benchmark result means.

/// SplitMix64 (Steele, Lea, Flood 2014): one `u64` of state, passes BigCrush,
/// and every seed (including 0) is a good one.
#[derive(Debug, Clone)]
pub struct Rng {
    state: u64,
}

const GOLDEN_GAMMA: u64 = 0x9e37_79b9_7f4a_7c15;

/// The SplitMix64 output function: a strong 64-bit mixer.
pub fn mix64(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// A seed for an independent stream named by `parts` under `seed`, so e.g.
/// session 17's text does not depend on how many numbers session 16 drew.
pub fn derive(seed: u64, parts: &[u64]) -> u64 {
    parts.iter().fold(mix64(seed ^ GOLDEN_GAMMA), |acc, &p| {
        mix64(acc.wrapping_add(GOLDEN_GAMMA) ^ mix64(p.wrapping_add(GOLDEN_GAMMA)))
    })
}

/// FNV-1a 64 of `bytes`: a stable hash for strings (routing keys).
pub fn fnv1a64(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |hash, &b| {
        (hash ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

impl Rng {
    pub fn new(seed: u64) -> Self {
        Rng { state: seed }
    }

    pub fn next_u64(&mut self) -> u64 {
        self.state = self.state.wrapping_add(GOLDEN_GAMMA);
        mix64(self.state)
    }

    /// Uniform in [0, 1), 53 bits.
    pub fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }

    /// Uniform in `0..n`; `n == 0` gives 0. Lemire's multiply-shift: the
    /// bias is below 2^-32 for the small `n` used here.
    pub fn below(&mut self, n: u64) -> u64 {
        ((u128::from(self.next_u64()) * u128::from(n)) >> 64) as u64
    }

    /// Uniform in `lo..=hi` (`lo <= hi`).
    pub fn range(&mut self, lo: u64, hi: u64) -> u64 {
        lo + self.below(hi - lo + 1)
    }

    /// Exponentially distributed with the given mean (0 when `mean <= 0`).
    pub fn exp(&mut self, mean: f64) -> f64 {
        if mean <= 0.0 {
            return 0.0;
        }
        // 1 - unit() is in (0, 1], so the logarithm is finite.
        -mean * (1.0 - self.unit()).ln()
    }
}

/// Zipf-like distribution over `1..=n`: P(k) proportional to k^-s. `s = 0` is
/// uniform; larger `s` puts more weight on small k.
#[derive(Debug, Clone)]
pub struct Zipf {
    /// Cumulative weights, `cdf[k-1]` = sum of weights of 1..=k.
    cdf: Vec<f64>,
}

impl Zipf {
    /// `n >= 1`, `s` finite and non-negative (checked by the CLI).
    pub fn new(n: u64, s: f64) -> Self {
        let mut total = 0.0;
        let cdf = (1..=n.max(1))
            .map(|k| {
                total += (k as f64).powf(-s);
                total
            })
            .collect();
        Zipf { cdf }
    }

    /// A value in `1..=n`.
    pub fn sample(&self, rng: &mut Rng) -> u64 {
        let total = self.cdf.last().copied().unwrap_or(0.0);
        let x = rng.unit() * total;
        let index = self.cdf.partition_point(|&c| c <= x);
        index.min(self.cdf.len().saturating_sub(1)) as u64 + 1
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn splitmix_reference_values() {
        // First outputs of SplitMix64 seeded with 0 (reference implementation).
        let mut rng = Rng::new(0);
        assert_eq!(rng.next_u64(), 0xe220_a839_7b1d_cdaf);
        assert_eq!(rng.next_u64(), 0x6e78_9e6a_a1b9_65f4);
    }

    #[test]
    fn derived_streams_differ_and_repeat() {
        assert_eq!(derive(7, &[1, 2]), derive(7, &[1, 2]));
        assert_ne!(derive(7, &[1, 2]), derive(7, &[2, 1]));
        assert_ne!(derive(7, &[1]), derive(8, &[1]));
        assert_ne!(derive(7, &[0]), derive(7, &[0, 0]));
    }

    #[test]
    fn distributions_stay_in_range() {
        let mut rng = Rng::new(3);
        let zipf = Zipf::new(5, 1.2);
        let mut counts = [0u32; 5];
        for _ in 0..10_000 {
            assert!(rng.unit() < 1.0);
            assert!(rng.below(7) < 7);
            assert!((3..=4).contains(&rng.range(3, 4)));
            assert!(rng.exp(10.0) >= 0.0);
            let k = zipf.sample(&mut rng);
            counts[(k - 1) as usize] += 1;
        }
        // Monotone popularity: 1 is the most likely value, 5 the least.
        assert!(counts.windows(2).all(|w| w[0] > w[1]), "{counts:?}");
        assert_eq!(Zipf::new(1, 1.0).sample(&mut rng), 1);
        assert_eq!(rng.exp(0.0), 0.0);
    }
}
