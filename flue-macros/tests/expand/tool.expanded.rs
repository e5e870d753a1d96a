/// Search the open issues in a public GitHub repository.
#[allow(non_camel_case_types)]
#[derive(
    ::core::clone::Clone,
    ::core::marker::Copy,
    ::core::fmt::Debug,
    ::core::default::Default,
)]
struct search_github_issues;
const _: () = {
    use ::flue_runtime::__private::flue_core as __flue;
    #[derive(
        ::flue_runtime::__private::serde::Deserialize,
        ::flue_runtime::__private::schemars::JsonSchema
    )]
    #[serde(crate = "::flue_runtime::__private::serde")]
    #[schemars(crate = "::flue_runtime::__private::schemars")]
    #[allow(non_camel_case_types)]
    struct __FlueToolArgs_search_github_issues {
        /// Repository owner
        owner: String,
        /// Words from the issue title or text
        query: String,
    }
    #[allow(dead_code)]
    async fn __flue_tool_body(
        ctx: &ToolContext,
        owner: String,
        query: String,
    ) -> Result<String, ToolError> {
        Ok(format!("{owner}: {query}"))
    }
    const _: () = __flue::tool::progress_argument::<String>();
    const _: () = __flue::tool::tool_argument::<String>();
    #[automatically_derived]
    #[allow(deprecated)]
    impl __flue::tool::ToolHandler for search_github_issues {
        fn definition(&self) -> &__flue::tool::ToolDefinition {
            static DEFINITION: __flue::tool::ToolDefinition = __flue::tool::ToolDefinition::from_checked(
                "search_github_issues",
                "Search the open issues in a public GitHub repository.",
                __flue::data::SchemaSource::Typed(
                    __flue::tool::arguments::<__FlueToolArgs_search_github_issues>()
                        .schema,
                ),
                ::core::option::Option::Some("query"),
                &["GITHUB_TOKEN"],
                false,
            );
            &DEFINITION
        }
        fn call(
            &self,
            __flue_ctx: __flue::ToolContext,
            __flue_json: ::flue_runtime::__private::serde_json::Value,
        ) -> __flue::BoxFuture<'_, __flue::ToolOutput> {
            ::std::boxed::Box::pin(async move {
                let __flue_args: __FlueToolArgs_search_github_issues = match (__flue::tool::arguments::<
                    __FlueToolArgs_search_github_issues,
                >()
                    .parse)(__flue_json)
                {
                    ::core::result::Result::Ok(__flue_args) => __flue_args,
                    ::core::result::Result::Err(__flue_output) => return __flue_output,
                };
                let _ = &__flue_ctx;
                {
                    use __flue::tool::{
                        ConvertibleReturn as _, DisplayErrorReturn as _,
                        OtherReturn as _, TextErrorReturn as _,
                    };
                    let __flue_returned = __flue::send_body(
                            __flue_tool_body(
                                &__flue_ctx,
                                __flue_args.owner,
                                __flue_args.query,
                            ),
                        )
                        .await;
                    let __flue_returned = (&&&__flue::tool::Returned(&__flue_returned))
                        .__flue_tool_return()
                        .adapt(__flue_returned);
                    __flue::tool::tool_return(__flue_returned)
                }
            })
        }
    }
};
