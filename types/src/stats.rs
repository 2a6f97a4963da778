//! Summaries of measured samples, shared by calibration and the benchmarks.

/// The median of `samples` (not empty): the middle one, or the mean of the two middle ones.
pub fn median(samples: &mut [f64]) -> f64 {
    samples.sort_by(f64::total_cmp);
    let n = samples.len();
    if n % 2 == 1 {
        samples[n / 2]
    } else {
        (samples[n / 2 - 1] + samples[n / 2]) / 2.0
    }
}

/// A count and a sum, halved at each run's start (`halve`) so the latest runs weigh most: what the
/// stack learns of a host from its runs (an expert fetch's milliseconds, the disk's GB/s as served).
/// Saved as `[count, sum]`.
#[derive(Debug, Clone, Copy, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Decayed(f64, f64);

impl Decayed {
    /// Counts one sample of `x`.
    pub fn add(&mut self, x: f64) {
        *self = Decayed(self.0 + 1.0, self.1 + x);
    }

    /// Past samples count half.
    pub fn halve(&mut self) {
        *self = Decayed(self.0 / 2.0, self.1 / 2.0);
    }

    /// The sum over the count; None before anything was added.
    pub fn mean(&self) -> Option<f64> {
        (self.0 > 0.0).then(|| self.1 / self.0)
    }

    /// The (decayed) count of samples.
    pub fn count(&self) -> f64 {
        self.0
    }

    /// These figures unless there are none, else `there`'s.
    pub fn or(self, there: Decayed) -> Decayed {
        if self.0 > 0.0 {
            self
        } else {
            there
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_median_is_the_middle_sample_or_the_mean_of_the_two() {
        assert_eq!(median(&mut [3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(&mut [0.026, 0.044, 0.040, 0.041]), 0.0405);
        assert_eq!(median(&mut [5.0]), 5.0);
    }

    /// Halving weighs later samples more; an empty one has no mean and yields to another.
    #[test]
    fn a_decayed_mean_weighs_the_latest_samples_most() {
        let mut d = Decayed::default();
        assert_eq!(d.mean(), None);
        d.add(1.0);
        d.halve();
        d.add(4.0);
        assert_eq!(d.mean(), Some(3.0), "(0.5 + 4) / 1.5");
        assert_eq!(d.count(), 1.5);
        assert_eq!(Decayed::default().or(d), d);
        assert_eq!(d.or(Decayed::default()), d);
        let json = serde_json::to_string(&d).unwrap();
        assert_eq!(
            (json.as_str(), serde_json::from_str::<Decayed>(&json).unwrap()),
            ("[1.5,4.5]", d)
        );
    }
}
