//! Every fuzz target builds its seeds, accepts them unmutated (so mutation starts from inputs
//! that reach deep into the code), and survives a short mutation run without a panic.
use std::time::Duration;

#[test]
fn every_target_accepts_its_seeds_and_survives_a_short_run() {
    let out = tempfile::tempdir().unwrap();
    for mut target in wick_fuzz::targets::all().unwrap() {
        let seeds = target.seeds.clone();
        // The built-in seeds come first; real templates may follow and need not all render.
        let first = (target.run)(&seeds[0]);
        assert!(first, "{}: the first seed is refused", target.name);
        let name = target.name;
        let report = wick_fuzz::run_target(target, Duration::from_millis(300), 1, out.path());
        assert!(report.findings.is_empty(), "{name}: {:?}", report.findings);
        assert!(report.inputs > seeds.len() as u64, "{name}: {report:?}");
    }
}
