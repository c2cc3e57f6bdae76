//! The phase that kills the server with SIGKILL between a payment's two
//! external calls: the charge is made and its step confirmed, the receipt
//! not sent. After a restart the retry resumes: the charge step is found
//! confirmed (its evidence is the provider's charge) and skipped, the
//! receipt is sent once, and the payment completes.

use std::path::Path;
use std::time::Duration;

use super::audit::{ledger_count, Tally};
use super::{retry_until_settled, Audit, Client, DemoResult, Row, Server, ServerFault};
use crate::provider::read_ledger;
use crate::receipts::{read_receipts, receipts_path};
use crate::server::BETWEEN_STEPS_LINE;
use crate::store::Store;

/// Runs the phase on `store`; `client` is pointed at each server in turn.
pub(super) async fn phase(
    store: &Store,
    client: &mut Client,
    audit: &mut Audit,
    ledger: &Path,
    run: &str,
) -> DemoResult<Row> {
    let mut row = Row {
        name: "SIGKILL between the 2 calls",
        ..Row::default()
    };
    println!("\n== {}", row.name);
    let before = ledger_count(ledger, run)?;
    let key = format!("{run}-between");
    let amount = 5_300;

    let mut server = Server::start(store, ledger, ServerFault::PauseBetweenSteps).await?;
    client.base = server.base.clone();
    println!(
        "    server restarted on {} to hold each payment between its charge and its receipt",
        server.base
    );
    // The request hangs once the charge is confirmed; it ends when the
    // server dies.
    let pending = {
        let (client, key) = (client.clone(), key.clone());
        tokio::spawn(async move { client.pay(&key, amount, "between steps", None).await })
    };
    row.requests += 1;
    let line = server
        .line_starting(BETWEEN_STEPS_LINE, Duration::from_secs(20))
        .await?;
    let charge_id = line.rsplit(' ').next().unwrap_or_default().to_owned();
    let charged = charges_for(ledger, &key)?;
    let receipted = receipts_for(ledger, &key)?;
    println!(
        "    1st attempt: charge {charge_id} made and its step confirmed; the card ledger has \
         {charged} charge for the key, the receipt ledger {receipted} receipts"
    );
    audit.expect(charged == 1 && receipted == 0, || {
        format!("{key}: before the kill: {charged} charges, {receipted} receipts")
    });

    let status = server.kill().await?;
    println!("    server killed with SIGKILL before the receipt call: {status}");
    audit.expect(!status.success(), || {
        "the killed server exited cleanly".into()
    });
    let first = pending.await?;
    audit.expect(first.status.is_none(), || {
        format!(
            "{key}: expected the connection to fail, got {:?}",
            first.status
        )
    });

    let restarted = Server::start(store, ledger, ServerFault::None).await?;
    client.base = restarted.base.clone();
    println!(
        "    server restarted on {}, without fault injection; the client retries",
        restarted.base
    );
    if let Some(answer) = retry_until_settled(
        client,
        audit,
        &mut row,
        &key,
        amount,
        "between steps (retry)",
    )
    .await
    {
        audit.expect(
            !answer.replayed
                && answer.steps.as_deref() == Some("charge=confirmed-earlier, receipt=sent"),
            || {
                format!(
                    "{key}: expected a resumed run (charge skipped, receipt sent), got \
                     replayed={} steps={:?}",
                    answer.replayed, answer.steps
                )
            },
        );
        audit.expect(answer.payment_id().as_deref() == Some(&charge_id), || {
            format!("{key}: told {:?}, charged {charge_id}", answer.payment_id())
        });
        let receipt = read_receipts(&receipts_path(ledger))?
            .entries
            .into_iter()
            .find(|r| r.client_key == key);
        println!(
            "    resumed: the retry found step \"charge\" confirmed ({charge_id}) and skipped \
             the call; it sent receipt {} once and completed: 201",
            receipt.map_or_else(|| "(none!)".to_owned(), |r| r.id)
        );
        let again = client
            .pay(&key, amount, "between steps (retry)", None)
            .await;
        row.requests += 1;
        row.replays += u32::from(again.replayed);
        audit.expect(again.status == Some(201) && again.replayed, || {
            format!("{key}: a later retry got {:?}", again.status)
        });
        if again.status == Some(201) {
            audit.success(&key, &again);
        }
        println!(
            "    a later retry: {} replayed={}",
            again.status.unwrap_or(0),
            again.replayed
        );
    }
    let (charged, receipted) = (charges_for(ledger, &key)?, receipts_for(ledger, &key)?);
    audit.expect(charged == 1 && receipted == 1, || {
        format!("{key}: after the resume: {charged} charges, {receipted} receipts")
    });
    println!(
        "    ledgers: {charged} charge and {receipted} receipt for the payment: neither call \
         was made twice"
    );
    row.charges = ledger_count(ledger, run)? - before;
    restarted.stop().await?;
    Tally::print_phase(ledger, &key, audit)?;
    Ok(row)
}

/// The charges for client key `key`.
fn charges_for(ledger: &Path, key: &str) -> DemoResult<usize> {
    Ok(read_ledger(ledger)?
        .entries
        .iter()
        .filter(|c| c.client_key == key)
        .count())
}

/// The receipts for client key `key`.
fn receipts_for(ledger: &Path, key: &str) -> DemoResult<usize> {
    Ok(read_receipts(&receipts_path(ledger))?
        .entries
        .iter()
        .filter(|r| r.client_key == key)
        .count())
}
