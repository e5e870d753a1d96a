//! The compile-time rules of `#[tool]`.

use super::model::{Arguments, ToolModel};
use crate::docs::Description;
use crate::errors::Errors;

const RESERVED: [&str; 5] = ["task", "activate_skill", "read_skill_resource", "finish", "give_up"];

pub(crate) fn check(model: &ToolModel, errors: &Errors) {
    crate::render_hooks::check_outside_render(&model.function.block, crate::render_hooks::Body::Tool, errors);
    let sig = &model.function.sig;
    if sig.asyncness.is_none() {
        errors.spanned(
            sig.fn_token,
            "a tool function must be `async`: tools run while the agent responds and may wait on I/O",
        );
    }
    if let Some(unsafety) = &sig.unsafety {
        errors.spanned(
            unsafety,
            "a tool function cannot be `unsafe`: the runtime calls it from safe code, so nothing would uphold its safety contract; make it safe and use `unsafe` blocks inside",
        );
    }
    if matches!(model.description, Description::None) {
        errors.spanned(
            &sig.ident,
            "a tool needs a description: add a doc comment (`/// …`) saying what it does — the model reads it to decide when to call the tool",
        );
    }
    let (name, span) = &model.name;
    if name.is_empty()
        || name.len() > 64
        || !name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
    {
        errors.push(syn::Error::new(
            *span,
            format!("tool name \"{name}\" must match ^[A-Za-z0-9_-]{{1,64}}$ (what every provider accepts)"),
        ));
    } else if RESERVED.contains(&name.as_str()) {
        errors.push(syn::Error::new(
            *span,
            format!(
                "tool name \"{name}\" is reserved by the framework ({}); choose another name, or set `name = \"…\"`",
                RESERVED.join(", ")
            ),
        ));
    }
    if !crate::lifetimes_only(&sig.generics) && matches!(model.arguments, Arguments::Plain(_)) {
        errors.spanned(
            &sig.generics,
            "a generic tool takes its arguments as one `args: T` parameter",
        );
    }
    for lifetime in model.misplaced_lifetimes() {
        errors.spanned(
            &lifetime,
            format!(
                "a tool's type parameters may name the function's lifetimes only in outlives bounds (`T: {lifetime}`): the tool outlives every call, so `{lifetime}` cannot be part of its type"
            ),
        );
    }
    if let (Some(progress), Arguments::Plain(fields)) = (&model.options.progress_argument, &model.arguments)
        && !fields
            .iter()
            .any(|field| field.json_name().is_some_and(|name| name == progress.value()))
        // A rejected parameter (reported) may be the one it names.
        && !model.rejected_parameter
        // A flattened parameter's fields are arguments too, which only the schema knows:
        // `use_tool` checks the name then.
        && !fields.iter().any(|field| field.flattened())
    {
        let known = fields
            .iter()
            .filter_map(|field| field.json_name())
            .map(|name| format!("`{name}`"))
            .collect::<Vec<_>>()
            .join(", ");
        let known = if known.is_empty() {
            "it takes none".to_owned()
        } else {
            known
        };
        errors.spanned(
            progress,
            format!(
                "progress_argument \"{}\" is not one of the tool's arguments ({known})",
                progress.value()
            ),
        );
    }
    if let Arguments::Plain(fields) = &model.arguments {
        for (option, span) in fields.iter().filter_map(super::model::Field::schema_only) {
            let instead = if option == "rename" {
                "#[serde(rename = \"…\")]".to_owned()
            } else {
                format!("#[serde({option})]")
            };
            errors.push(syn::Error::new(
                span,
                format!(
                    "`#[schemars({option})]` alone changes the argument in the schema but not for the parser, which would then refuse what the model sends: write `{instead}` instead (schemars reads serde's attributes too)"
                ),
            ));
        }
    }
    for secret in model.options.secrets.iter().flatten() {
        if secret.value().trim().is_empty() {
            errors.spanned(secret, "a secret is a non-empty environment variable name");
        }
    }
    check_secrets_read(model, errors);
}

/// A `ctx.secret("NAME")` in the body, on the tool's context and with a literal name, must name
/// a declared secret: an undeclared one is refused at run time, when the model first calls the
/// tool. Only what the tokens show is checked: a name computed at run time, a call inside a
/// macro, or a body that binds the context's name again is left to the run-time check.
fn check_secrets_read(model: &ToolModel, errors: &Errors) {
    use syn::visit::Visit;
    // Without the context, nothing reads a secret; with a malformed list (reported), the
    // author's list is not known.
    if !model.has_context || model.options.secrets_malformed {
        return;
    }
    let Some(syn::FnArg::Typed(context)) = model.function.sig.inputs.first() else {
        return;
    };
    let syn::Pat::Ident(context) = &*context.pat else {
        return;
    };
    let declared: Vec<String> = model.options.secrets.iter().flatten().map(syn::LitStr::value).collect();
    let mut reads = SecretReads {
        context: &context.ident,
        rebound: false,
        undeclared: Vec::new(),
        declared: &declared,
    };
    reads.visit_block(&model.function.block);
    if reads.rebound {
        return;
    }
    let list = if declared.is_empty() {
        "it declares none".to_owned()
    } else {
        format!(
            "declared: {}",
            declared
                .iter()
                .map(|name| format!("`{name}`"))
                .collect::<Vec<_>>()
                .join(", ")
        )
    };
    for name in reads.undeclared {
        errors.spanned(
            &name,
            format!(
                "`{}.secret({:?})` reads a secret this tool does not declare ({list}): add it to `#[tool(secrets = [..])]`, or correct the name",
                context.ident,
                name.value()
            ),
        );
    }
}

/// The literal names of the secrets a tool body reads through its context.
struct SecretReads<'a> {
    context: &'a syn::Ident,
    /// The body binds the context's name again (a `let`, a closure's or a match arm's
    /// pattern): a call on that name may not be the context's.
    rebound: bool,
    undeclared: Vec<syn::LitStr>,
    declared: &'a [String],
}

impl<'ast> syn::visit::Visit<'ast> for SecretReads<'_> {
    fn visit_pat_ident(&mut self, pat: &'ast syn::PatIdent) {
        if pat.ident == *self.context {
            self.rebound = true;
        }
        syn::visit::visit_pat_ident(self, pat);
    }

    fn visit_expr_method_call(&mut self, call: &'ast syn::ExprMethodCall) {
        let on_context = matches!(&*call.receiver, syn::Expr::Path(path) if path.qself.is_none() && path.path.is_ident(self.context));
        if on_context
            && call.method == "secret"
            && let [
                syn::Expr::Lit(syn::ExprLit {
                    lit: syn::Lit::Str(name),
                    ..
                }),
            ] = call.args.iter().collect::<Vec<_>>()[..]
            && !self.declared.contains(&name.value())
        {
            self.undeclared.push(name.clone());
        }
        syn::visit::visit_expr_method_call(self, call);
    }

    /// An item in the body (a nested function) has its own names.
    fn visit_item(&mut self, _item: &'ast syn::Item) {}
}
