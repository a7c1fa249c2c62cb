//! The body both fingerprint benches measure.

/// An order of about `bytes` bytes whose every line item's members arrive
/// out of key order (`sku, qty, note, price`), as JSON.
pub(crate) fn json_body(bytes: usize) -> Vec<u8> {
    let mut items: Vec<String> = Vec::new();
    let mut i = 0;
    while items.iter().map(|s| s.len() + 1).sum::<usize>() < bytes {
        items.push(format!(
            r#"{{"sku":"sku-{i}","qty":{},"note":"line {i} of the order","price":{}.5}}"#,
            i % 7 + 1,
            i * 3
        ));
        i += 1;
    }
    format!(
        r#"{{"customer_id":"cust-1","currency":"EUR","items":[{}]}}"#,
        items.join(",")
    )
    .into_bytes()
}
