//! How far up the x86 instruction sets the CPU kernels may go: every set the CPU reports by
//! default, or, with `LAYERSTREAM_CPU_ISA=avx2`, no further than AVX2 — so an AVX-512 machine runs
//! (and measures, beside llama.cpp built without AVX-512) the kernels a CPU without AVX-512 runs —
//! or with `avx512`, AVX-512 and VNNI but not AMX's tiles (beside llama.cpp built without AMX).
//! The tokens do not change: every kernel gives the same bits on any set.

/// The environment variable that caps the instruction sets.
pub const ENV: &str = "LAYERSTREAM_CPU_ISA";

/// The highest instruction set the kernels may use.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Cap {
    /// Whatever the CPU reports (AVX-512 with VNNI where it has them).
    Native,
    /// AVX-512 with VNNI at most: no AMX tiles.
    Avx512,
    /// AVX2 with FMA and F16C at most, as on a CPU without AVX-512.
    Avx2,
}

/// The cap `value` (the variable's value, None when unset) asks for.
pub fn parse(value: Option<&str>) -> Result<Cap, String> {
    match value.map(str::trim) {
        None | Some("") => Ok(Cap::Native),
        Some(v) if v.eq_ignore_ascii_case("native") => Ok(Cap::Native),
        Some(v) if v.eq_ignore_ascii_case("avx512") => Ok(Cap::Avx512),
        Some(v) if v.eq_ignore_ascii_case("avx2") => Ok(Cap::Avx2),
        Some(v) => Err(format!("{ENV}={v:?}: expected `native` (the default), `avx512` or `avx2`")),
    }
}

/// This process's cap, read once; an error names a value it does not know (the worker and the
/// CLI refuse to start on one).
pub fn cap() -> Result<Cap, String> {
    static CAP: std::sync::OnceLock<Result<Cap, String>> = std::sync::OnceLock::new();
    CAP.get_or_init(|| parse(std::env::var(ENV).ok().as_deref())).clone()
}

/// Whether the kernels may use AVX-512 where the CPU has it (an unknown cap counts as the
/// default: the processes refuse it before any kernel runs).
pub fn avx512() -> bool {
    cap() != Ok(Cap::Avx2)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_cap_reads_its_values_and_names_another() {
        assert_eq!(parse(None), Ok(Cap::Native));
        assert_eq!(parse(Some("")), Ok(Cap::Native));
        assert_eq!(parse(Some("Native")), Ok(Cap::Native));
        assert_eq!(parse(Some(" avx2 ")), Ok(Cap::Avx2));
        assert_eq!(parse(Some("AVX512")), Ok(Cap::Avx512));
        let e = parse(Some("amx")).unwrap_err();
        assert!(e.contains("LAYERSTREAM_CPU_ISA=\"amx\"") && e.contains("avx2"), "{e}");
    }
}
