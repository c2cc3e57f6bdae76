//! `idem-conformance URL [options]`: checks an HTTP API's `Idempotency-Key`
//! behaviour from outside, prints a table and optionally writes JSON.
//! conformance/README.md documents the checks and what a target must offer.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use idem_conformance::{Config, Restart, Verdict};

const USAGE: &str = "usage: idem-conformance URL [options]

  --path PATH             the route under test (default /payments)
  --body JSON             a request body (default {\"amount\":1000,\"currency\":\"EUR\",\"customer\":\"cus_conformance\"})
  --other-body JSON       a body that is a different request (default: --body's first number plus one)
  --id-pointer POINTER    where a 2xx body holds the execution's id (default /id)
  --replay-header H       the replay marker: 'NAME: VALUE', NAME (any value) or none
                          (default 'Idempotent-Replayed: true')
  --key-required          the route documents the key as required
  --max-key-bytes N       the longest key accepted (default 255)
  --concurrency N         duplicates sent at once (default 8)
  --slow-header 'N: V'    a header that keeps a request in flight for a second or more
  --slow-path PATH        a route like PATH that stays in flight for a second or more
  --status-header NAME    a header whose value (400-599) the target answers at once
  --count-url URL         GET URL ({key} replaced) answers how often the work ran for a key
  --ttl SECS              the server's TTL for a completed key
  --restart-cmd CMD       sh -c CMD kills and restarts the server (the crash check)
  --ignore-header NAME    leave NAME out of the replay comparison (repeatable)
  --timeout SECS          per request (default 10)
  --json PATH             also write the report as JSON

Exit status: 0 if no check failed, 1 if one did, 2 on a usage or target error.";

fn main() -> ExitCode {
    match try_main() {
        Ok(code) => code,
        Err(e) => {
            eprintln!("idem-conformance: {e}");
            ExitCode::from(2)
        }
    }
}

fn try_main() -> Result<ExitCode, Box<dyn std::error::Error>> {
    // `args_os`: `std::env::args` panics on an argument that is not UTF-8.
    let args = std::env::args_os()
        .skip(1)
        .map(|a| {
            a.into_string()
                .map_err(|a| format!("argument {a:?} is not valid UTF-8"))
        })
        .collect::<Result<Vec<String>, String>>()?;
    let Some(args) = parse_args(args)? else {
        println!("{USAGE}");
        return Ok(ExitCode::SUCCESS);
    };
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    let report = runtime.block_on(idem_conformance::run(&args.config))?;
    print!("{}", report.table());
    if let Some(path) = &args.json {
        std::fs::write(path, report.to_json() + "\n")
            .map_err(|e| format!("cannot write {}: {e}", path.display()))?;
    }
    Ok(if report.with(Verdict::Fail).next().is_some() {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    })
}

struct Args {
    config: Config,
    json: Option<PathBuf>,
}

/// The arguments; `None` for `--help`.
fn parse_args(args: impl IntoIterator<Item = String>) -> Result<Option<Args>, String> {
    let mut args = args.into_iter();
    let mut url = None;
    let mut config = Config::new("");
    let mut json = None;
    while let Some(arg) = args.next() {
        let mut value = || {
            args.next()
                .ok_or_else(|| format!("{arg} needs a value\n{USAGE}"))
        };
        match arg.as_str() {
            "-h" | "--help" => return Ok(None),
            "--path" => config.path = value()?,
            "--body" => config.body = json_arg(&arg, &value()?)?,
            "--other-body" => config.other_body = Some(json_arg(&arg, &value()?)?),
            "--id-pointer" => config.id_pointer = value()?,
            "--replay-header" => {
                let v = value()?;
                config.replay_header = match v.split_once(':') {
                    _ if v.eq_ignore_ascii_case("none") => None,
                    Some((n, val)) => {
                        Some((n.trim().to_ascii_lowercase(), Some(val.trim().into())))
                    }
                    None => Some((v.trim().to_ascii_lowercase(), None)),
                };
            }
            "--key-required" => config.key_required = true,
            "--max-key-bytes" => config.max_key_bytes = number(&arg, &value()?)?,
            "--concurrency" => config.concurrency = number(&arg, &value()?)?,
            "--slow-header" => {
                let v = value()?;
                let (n, val) = v
                    .split_once(':')
                    .ok_or_else(|| format!("--slow-header {v:?}: expected 'NAME: VALUE'"))?;
                config.slow_header = Some((n.trim().into(), val.trim().into()));
            }
            "--slow-path" => config.slow_path = Some(value()?),
            "--status-header" => config.status_header = Some(value()?),
            "--count-url" => config.count_url = Some(value()?),
            "--ttl" => config.ttl = Some(seconds(&arg, &value()?)?),
            "--restart-cmd" => config.restart = Some(Restart::command(value()?)),
            "--ignore-header" => config.ignore_headers.push(value()?.to_ascii_lowercase()),
            "--timeout" => config.request_timeout = seconds(&arg, &value()?)?,
            "--json" => json = Some(PathBuf::from(value()?)),
            other if other.starts_with('-') => {
                return Err(format!("unknown option {other:?}\n{USAGE}"))
            }
            other if url.is_none() => url = Some(other.to_owned()),
            other => return Err(format!("unexpected argument {other:?}\n{USAGE}")),
        }
    }
    let url = url.ok_or_else(|| format!("no URL\n{USAGE}"))?;
    if !url.starts_with("http://") && !url.starts_with("https://") {
        return Err(format!("{url:?} is not an http:// URL"));
    }
    config.base = url;
    Ok(Some(Args { config, json }))
}

fn json_arg(arg: &str, v: &str) -> Result<serde_json::Value, String> {
    serde_json::from_str(v).map_err(|e| format!("{arg} {v:?} is not JSON: {e}"))
}

fn number(arg: &str, v: &str) -> Result<usize, String> {
    v.parse()
        .map_err(|_| format!("{arg} {v:?} is not a whole number"))
}

fn seconds(arg: &str, v: &str) -> Result<Duration, String> {
    v.parse::<f64>()
        .ok()
        .and_then(|s| Duration::try_from_secs_f64(s).ok())
        .ok_or_else(|| format!("{arg} {v:?} is not a number of seconds"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(args: &[&str]) -> Result<Option<Args>, String> {
        parse_args(args.iter().map(|s| s.to_string()))
    }

    #[test]
    fn options_reach_the_config() -> Result<(), String> {
        let args = parse(&[
            "http://127.0.0.1:9",
            "--path",
            "/orders",
            "--replay-header",
            "X-Cache: HIT",
            "--slow-header",
            "x-simulate-fault: slow",
            "--ttl",
            "2.5",
            "--json",
            "r.json",
        ])?
        .ok_or("no args")?;
        assert_eq!(args.config.base, "http://127.0.0.1:9");
        assert_eq!(args.config.path, "/orders");
        assert_eq!(
            args.config.replay_header,
            Some(("x-cache".into(), Some("HIT".into())))
        );
        assert_eq!(
            args.config.slow_header,
            Some(("x-simulate-fault".into(), "slow".into()))
        );
        assert_eq!(args.config.ttl, Some(Duration::from_millis(2500)));
        assert_eq!(args.json, Some(PathBuf::from("r.json")));
        let none = parse(&["http://h", "--replay-header", "none"])?.ok_or("no args")?;
        assert_eq!(none.config.replay_header, None);
        Ok(())
    }

    #[test]
    fn bad_arguments_are_refused() {
        assert!(parse(&[]).is_err());
        assert!(parse(&["localhost:8080"]).is_err());
        assert!(parse(&["http://h", "--ttl", "soon"]).is_err());
        assert!(parse(&["http://h", "--body", "{"]).is_err());
        assert!(parse(&["http://h", "--slow-header", "novalue"]).is_err());
        assert!(parse(&["http://h", "--frobnicate"]).is_err());
        assert!(matches!(parse(&["--help"]), Ok(None)));
    }
}
