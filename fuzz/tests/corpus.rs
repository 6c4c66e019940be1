//! Every input of the committed corpus (`fuzz/corpus/differential`, grown
//! by `cargo xtask fuzz`) passes the differential check: the regression
//! suite of everything the fuzzer has reached.

#[test]
fn the_committed_corpus_passes() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("corpus/differential");
    let mut files: Vec<_> = std::fs::read_dir(&dir)
        .expect("the corpus is committed")
        .map(|e| e.expect("readable").path())
        .collect();
    files.sort();
    assert!(!files.is_empty(), "empty corpus at {}", dir.display());
    for f in &files {
        let data = std::fs::read(f).expect("readable");
        if let Err(e) = attn_fuzz::run_one(&data) {
            panic!("{}: {e}", f.display());
        }
    }
}
