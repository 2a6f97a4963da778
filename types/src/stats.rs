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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_median_is_the_middle_sample_or_the_mean_of_the_two() {
        assert_eq!(median(&mut [3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(&mut [0.026, 0.044, 0.040, 0.041]), 0.0405);
        assert_eq!(median(&mut [5.0]), 5.0);
    }
}
