//! The binary refuses bad arguments with exit status 2 and a message,
//! never a panic (exit 101).

#[cfg(unix)]
#[test]
fn an_argument_that_is_not_utf8_is_a_usage_error_not_a_panic() {
    use std::os::unix::ffi::OsStrExt;
    let bad = std::ffi::OsStr::from_bytes(b"\xff\xfe");
    for args in [
        vec![bad],
        vec![
            std::ffi::OsStr::new("http://127.0.0.1:1"),
            std::ffi::OsStr::new("--body"),
            bad,
        ],
    ] {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_idem-conformance"))
            .args(&args)
            .output()
            .expect("the binary runs");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {stderr}");
        assert!(!stderr.contains("panicked"), "{args:?}: {stderr}");
        assert!(stderr.contains("not valid UTF-8"), "{args:?}: {stderr}");
    }
}
